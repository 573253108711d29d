"""Start the real server (real engine subprocess, real pipes, real HTTP on 127.0.0.1)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.conftest import TINY
from tests.helpers.processes import children, connection_owner, wait_until

API_PROCESS = "[-]m server.runtime.api_process"  # an API process's command line (pgrep -f)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path
    args: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def engine_pid(self) -> int:
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid), "-f", "engine"], capture_output=True, text=True)
        return int(out.stdout.split()[0])

    def metric(self, name: str, labels: str = "") -> float:
        """One sample from /metrics (summed over label sets that contain `labels`)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        total, seen = 0.0, False
        for line in text.splitlines():
            if line.startswith(name) and not line.startswith(name + "_") and labels in line:
                total += float(line.rsplit(" ", 1)[1])
                seen = True
        assert seen, f"{name}{{{labels}}} not in /metrics"
        return total

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_server(model: Path, tmp: Path, *args: str, wait: bool = True, env: dict[str, str] | None = None) -> Server:
    port = free_port()
    log = tmp / f"server-{port}.log"
    cmd = [
        sys.executable,
        "-m",
        "server",
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        "tiny",
        *args,
    ]
    # the grammar backend is built at the first constrained request (+1 s of CPU per server start otherwise);
    # the structured-output modules turn the warm-up back on
    full_env = {**os.environ, "SPINDLE_LOG_LEVEL": "WARNING", "SPINDLE_STRUCTURED_OUTPUTS_WARMUP": "0", **(env or {})}
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=full_env)
    server = Server(proc, port, log, list(args))
    if wait:
        wait_healthy(server)
    return server


def api_server_count(args: list[str]) -> int:
    for i, a in enumerate(args):
        if a == "--api-server-count":
            return int(args[i + 1])
        if a.startswith("--api-server-count="):
            return int(a.split("=", 1)[1])
    return 1


STARTUP_S = 300  # start-up includes building the CPU kernels where their sources changed (g++: up to 120 s)
# each /health poll of a starting server costs ~0.5 ms of the API process's CPU and ~0.6 ms of this one's (2 cores,
# a start of 10-30 s): 5 a second, not 10, for at most 0.1 s more wait
POLL_S = 0.2


def wait_healthy(server: Server, timeout: float = STARTUP_S) -> None:
    """/health 200 from the server; with several API processes, from every one of them (each answers 503
    until its own engine connection is up, and the kernel may hand the next connection to any)."""
    _wait_one_healthy(server, timeout)
    if (count := api_server_count(server.args)) > 1:
        wait_all_healthy(server, count, timeout)


def wait_all_healthy(server: Server, count: int, timeout: float = STARTUP_S) -> None:
    """Every API process has answered /health with 200 (which one accepted each connection is read from /proc:
    the kernel hands a new connection to whichever process accepts first)."""
    apis = children(server.proc.pid, API_PROCESS)
    assert len(apis) == count, apis
    served: set[int] = set()

    def one_more() -> bool:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as conn:
            conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = conn.recv(4096)
                assert chunk, f"the connection closed after {head!r}"
                head += chunk
            status = head.split(b" ", 2)[1]
            owner = connection_owner(server.port, conn.getsockname()[1], apis)  # the connection is kept alive
        assert owner is not None, "no API process holds the connection"
        if status == b"200":
            served.add(owner)
        return served == set(apis)

    wait_until(one_more, timeout, lambda: f"API processes {sorted(set(apis) - served)} answered /health 200")


def _wait_one_healthy(server: Server, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2) as client:  # not httpx.get: an SSL context per call costs ~25 ms of CPU
        while time.monotonic() < deadline:
            if server.proc.poll() is not None:
                raise RuntimeError(f"server exited {server.proc.returncode}:\n{server.log.read_text()[-3000:]}")
            try:
                if client.get(f"{server.url}/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(POLL_S)
    server.stop()
    raise RuntimeError(f"server not healthy in {timeout}s:\n{server.log.read_text()[-3000:]}")


@pytest.fixture(scope="session")
def qwen25_ckpt(checkpoints_root: Path) -> Path:
    """A Qwen2.5-tokenized tiny checkpoint: its <tool_call> tokens and tool-calling template."""
    from demo.checkpoints import write_random_checkpoint  # torch: only for tests that use it

    path = checkpoints_root / "qwen25"
    if path.exists():
        return path
    return write_random_checkpoint(
        path,
        "qwen2",
        **TINY,
        vocab_size=151_936,
        tie_word_embeddings=True,
        rope_theta=1_000_000.0,
        tokenizer_family="qwen2.5",
    )


@pytest.fixture(scope="session")
def qwen2_4k_ckpt(checkpoints_root: Path) -> Path:
    """The Qwen2 checkpoint with 4096 positions (long prompts: test_chaos.py, test_ui.py), built once."""
    from demo.checkpoints import write_random_checkpoint  # torch: only for tests that use it

    return write_random_checkpoint(
        checkpoints_root / "qwen2-4k",
        "qwen2",
        **{**TINY, "max_position_embeddings": 4096},
        vocab_size=151_646,
        tie_word_embeddings=True,
        rope_theta=1_000_000.0,
    )


@pytest.fixture(scope="session", params=["trio", "asyncio"])
def server(
    request: pytest.FixtureRequest, qwen2_ckpt: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """The shared server, default flags, once per Hypercorn worker class: the e2e suite runs on both."""
    s = start_server(qwen2_ckpt, tmp_path_factory.mktemp("srv"), "--worker-class", request.param)
    yield s
    s.stop()
