"""Issue 6, health and lifecycle, logs and progress, on real servers (one per signal scenario).

All servers start together in one module fixture (their loads overlap), and a watcher thread per
server polls /health from the moment its process starts, so "503 while loading" is observed, not slept.
"""

from __future__ import annotations

import json
import os
import pty
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import httpx
import pytest

from tests.e2e.conftest import Server, free_port, start_server, wait_healthy
from tests.e2e.test_abort_paths import HeldRequest
from tests.helpers.processes import alive, wait_gone, wait_until

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@dataclass
class Launched:
    server: Server
    health: list[int | None] = field(default_factory=list)  # every /health answer until the first 200
    pty_fd: int | None = None  # the master side when the server's output is a terminal
    pty_out: bytearray = field(default_factory=bytearray)  # what the server wrote to its terminal
    watcher: threading.Thread | None = None  # _watch_health's thread: done once it saw the first 200


def _watch_health(launched: Launched) -> None:
    url = f"{launched.server.url}/health"
    deadline = time.monotonic() + 180
    # one client: httpx.get builds an SSL context per call (~25 ms of CPU), six watchers' worth starved the loads
    with httpx.Client(timeout=2) as client:
        while time.monotonic() < deadline and launched.server.proc.poll() is None:
            try:
                code: int | None = client.get(url).status_code
            except httpx.TransportError:
                code = None
            launched.health.append(code)
            if code == 200:
                return
            time.sleep(0.02)


def _drain_pty(launched: Launched) -> None:
    assert launched.pty_fd is not None
    while True:
        try:
            chunk = os.read(launched.pty_fd, 65536)
        except OSError:  # EIO: every writer has closed the terminal
            return
        if not chunk:
            return
        launched.pty_out += chunk


def _launch(model: Path, tmp: Path, *args: str, env: dict[str, str] | None = None, tty: bool = False) -> Launched:
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
    # six servers start at once on two cores: no grammar backend build (tests/e2e/conftest.py says why)
    full_env = {**os.environ, "SPINDLE_LOG_LEVEL": "WARNING", "SPINDLE_STRUCTURED_OUTPUTS_WARMUP": "0", **(env or {})}
    pty_fd = None
    if tty:  # output on a terminal: the load progress is a redrawn bar
        pty_fd, slave = pty.openpty()
        proc = subprocess.Popen(cmd, stdout=slave, stderr=slave, env=full_env)
        os.close(slave)
    else:
        proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=full_env)
    launched = Launched(Server(proc, port, log, list(args)), pty_fd=pty_fd)
    launched.watcher = threading.Thread(target=_watch_health, args=(launched,), daemon=True)
    launched.watcher.start()
    if pty_fd is not None:
        threading.Thread(target=_drain_pty, args=(launched,), daemon=True).start()
    return launched


@pytest.fixture(scope="module")
def fleet(qwen2_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Launched]]:
    tmp = tmp_path_factory.mktemp("ops")
    servers = {
        "quiet": _launch(
            qwen2_ckpt,
            tmp,
            "--log-level",
            "info",
            "--sse-keepalive",
            "0.2",
            "--max-num-seqs",
            "1",
            "--max-num-queued-reqs",
            "1",
        ),
        "drain": _launch(qwen2_ckpt, tmp, "--shutdown-timeout", "60", "--log-level", "info", "--log-requests"),
        "cut": _launch(qwen2_ckpt, tmp, "--shutdown-timeout", "1", "--worker-class", "asyncio"),
        "twice": _launch(qwen2_ckpt, tmp, "--shutdown-timeout", "60"),
        "sigint": _launch(qwen2_ckpt, tmp, "--shutdown-timeout", "60", tty=True),
        "heartbeat": _launch(qwen2_ckpt, tmp, env={"SPINDLE_ENGINE_HEARTBEAT_TIMEOUT": "3"}),
    }
    try:
        for launched in servers.values():
            wait_healthy(launched.server, timeout=180)
            # its own poll may still be in flight or asleep: the health list is complete only once it ends
            assert launched.watcher is not None
            launched.watcher.join(30)
        yield servers
    finally:
        for launched in servers.values():
            launched.server.proc.kill()
            launched.server.proc.wait()


def events_of(text: str) -> list[str]:
    return [e[6:] for e in text.split("\n\n") if e.startswith("data: ")]


async def streams_then(
    server: Server, n: int, max_tokens: int, action: Callable[[httpx.AsyncClient], Awaitable[None]]
) -> list[tuple[float, list[str]]]:
    """Open n streams; once each has a first token, run `action`; return (end time, SSE payloads) per stream."""
    results: list[tuple[float, list[str]]] = []
    started = 0
    all_started = anyio.Event()
    async with httpx.AsyncClient(
        base_url=server.url, timeout=120, limits=httpx.Limits(max_connections=n + 5)
    ) as client:

        async def one(i: int) -> None:
            nonlocal started
            body = {
                "model": "tiny",
                "prompt": f"stream {i}",
                "max_tokens": max_tokens,
                "ignore_eos": True,
                "stream": True,
            }
            async with client.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                text = ""
                counted = False
                async for chunk in r.aiter_text():
                    text += chunk
                    if not counted and "data: {" in text:
                        counted = True
                        started += 1
                        if started == n:
                            all_started.set()
                results.append((time.monotonic(), events_of(text)))

        async with anyio.create_task_group() as tg:
            for i in range(n):
                tg.start_soon(one, i)
            await all_started.wait()
            await action(client)
    return results


def finishes(events: list[str]) -> list[str]:
    return [c["finish_reason"] for e in events[:-1] for c in json.loads(e).get("choices", []) if c["finish_reason"]]


async def wait_status(client: httpx.AsyncClient, path: str, status: int, timeout: float = 10) -> None:
    with anyio.fail_after(timeout):
        while (await client.get(path)).status_code != status:
            await anyio.sleep(0.02)


# ---- health -------------------------------------------------------------------------------------------


def test_health_is_503_while_loading_then_200(fleet: dict[str, Launched]) -> None:
    for name, launched in fleet.items():
        seen = [c for c in launched.health if c is not None]
        assert seen and seen[-1] == 200, (name, seen)
        assert 503 in seen[:-1], f"{name}: the listener was not up while the model loaded: {seen[:5]}..."


def test_engine_hang_turns_health_503_and_exits_nonzero(fleet: dict[str, Launched]) -> None:
    """SIGSTOP: the engine process lives but sends no heartbeat; health follows the heartbeat, not the pid."""
    srv = fleet["heartbeat"].server
    engine = srv.engine_pid()
    assert httpx.get(f"{srv.url}/health").status_code == 200
    held = HeldRequest(srv)  # started now, answered once the engine counts as dead
    os.kill(engine, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        # /health stays 200 while the silence is shorter than the heartbeat timeout (3 s), though the pid
        # lives on. At the timeout the engine is marked dead and the server stops listening in the same
        # instant: a new /health connection is then refused (a 503 only if it slipped into that instant).
        with httpx.Client(timeout=2, limits=httpx.Limits(max_keepalive_connections=0)) as fresh:  # new connections
            while True:
                try:
                    if fresh.get(f"{srv.url}/health").status_code != 200:
                        break
                except httpx.TransportError:
                    break
                assert time.monotonic() - stopped < 20, "/health stayed 200 with a silent engine"
                time.sleep(0.05)
        assert time.monotonic() - stopped > 2.0, "/health changed before the heartbeat timeout"
        # The server, still alive and winding down, answers the request it had started with the 503 /health
        # gives: the engine is dead for want of a heartbeat.
        status, body = held.finish()
        assert status == 503, (status, body)
        assert "no frame from the engine for 3 s" in json.loads(body)["error"]["message"], body
        assert srv.proc.wait(30) != 0  # a supervisor restarts it
        wait_gone(engine, 5)
    finally:
        if alive(engine):
            os.kill(engine, signal.SIGKILL)


# ---- SIGTERM / SIGINT ---------------------------------------------------------------------------------


async def test_sigterm_lets_5_streams_finish(fleet: dict[str, Launched]) -> None:
    srv = fleet["drain"].server
    engine = srv.engine_pid()
    refused: list[int] = []

    async def sigterm(client: httpx.AsyncClient) -> None:
        srv.proc.send_signal(signal.SIGTERM)
        await wait_status(client, "/health", 503)
        r = await client.post("/v1/completions", json={"model": "tiny", "prompt": "late", "max_tokens": 2})
        refused.append(r.status_code)
        refused.append(int((await client.get("/metrics")).text.count('reason="shutting_down"} 1.0')))

    results = await streams_then(srv, 5, 64, sigterm)
    assert refused == [503, 1]
    for _, events in results:
        assert events[-1] == "[DONE]" and finishes(events) == ["length"]
        assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert srv.proc.wait(30) == 0
    wait_gone(engine, 5)
    log = srv.log.read_text()
    # --log-requests: the access log carries the prompt and the output text
    assert re.search(
        r'route="POST /v1/completions" status=200 prompt_tokens=\d+ completion_tokens=64 '
        r"ttft=[\d.]+ duration=[\d.]+ finish_reason=length request_body=.*stream 3",
        log,
    )
    assert re.search(r'route="POST /v1/completions" status=503 .*finish_reason=- .*late', log)


async def test_sigterm_cuts_5_streams_cleanly_after_timeout(fleet: dict[str, Launched]) -> None:
    srv = fleet["cut"].server  # --shutdown-timeout 1
    engine = srv.engine_pid()
    sent: list[float] = []

    async def sigterm(client: httpx.AsyncClient) -> None:
        srv.proc.send_signal(signal.SIGTERM)
        sent.append(time.monotonic())

    results = await streams_then(srv, 5, 900, sigterm)
    for ended, events in results:
        assert 0.9 < ended - sent[0] < 6
        assert events[-1] == "[DONE]"
        assert "shutting down" in json.loads(events[-2])["error"]["message"]
        assert finishes(events) == []
    assert srv.proc.wait(30) == 0
    wait_gone(engine, 5)


@pytest.mark.parametrize("name", ["twice", "sigint"])
async def test_second_sigterm_or_sigint_stops_at_once(fleet: dict[str, Launched], name: str) -> None:
    srv = fleet[name].server  # --shutdown-timeout 60
    engine = srv.engine_pid()
    sent: list[float] = []

    async def signal_now(client: httpx.AsyncClient) -> None:
        if name == "twice":
            srv.proc.send_signal(signal.SIGTERM)
            await wait_status(client, "/health", 503)
        else:
            srv.proc.send_signal(signal.SIGINT)
        sent.append(time.monotonic())
        srv.proc.send_signal(signal.SIGTERM if name == "twice" else signal.SIGINT)

    results = await streams_then(srv, 5, 900, signal_now)
    for ended, events in results:
        assert ended - sent[0] < 5
        assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])
    srv.proc.wait(15)
    assert time.monotonic() - sent[0] < 15
    wait_gone(engine, 5)


@pytest.mark.parametrize("name", ["stopped_sigint", "stopped_twice"])
async def test_stops_within_2s_when_the_engine_stopped_reading(qwen2_ckpt: Path, tmp_path: Path, name: str) -> None:
    """SIGINT, or a second SIGTERM, ends the server within 2 s although the engine is SIGSTOPped with its
    stdin pipe full (big prompts queued behind a running stream); the stopped engine does not outlive it."""
    # its own server, after the fleet's: eight loading at once is too much for a 2-core CI box
    srv = start_server(qwen2_ckpt, tmp_path, "--shutdown-timeout", "60")  # the drain would wait 60 s
    try:
        await _stop_with_engine_stopped(srv, name)
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait()


async def _stop_with_engine_stopped(srv: Server, name: str) -> None:
    engine = srv.engine_pid()
    async with httpx.AsyncClient(base_url=srv.url, timeout=30, limits=httpx.Limits(max_connections=40)) as client:
        async with client.stream(
            "POST",
            "/v1/completions",
            json={"model": "tiny", "prompt": "go", "max_tokens": 900, "ignore_eos": True, "stream": True},
        ) as r:
            assert "data: {" in await r.aiter_text().__anext__()
            os.kill(engine, signal.SIGSTOP)
            big = {"model": "tiny", "prompt": list(range(100, 1000)), "max_tokens": 5}  # ~3 KB per frame
            async with anyio.create_task_group() as tg:

                async def post() -> None:
                    try:
                        await client.post("/v1/completions", json=big)
                    except httpx.TransportError:
                        pass  # the server went away: that is the point

                for _ in range(40):  # > 64 KiB of frames: the pipe to the stopped engine fills
                    tg.start_soon(post)
                with anyio.fail_after(20):
                    while pipe_bytes(engine) < 60_000:
                        await anyio.sleep(0.05)  # polling another process's pipe: no event to wait on
                if name == "stopped_twice":  # the first starts a drain (60 s); the second must not wait for it
                    srv.proc.send_signal(signal.SIGTERM)
                    async with httpx.AsyncClient(base_url=srv.url, timeout=5) as probe:
                        await wait_status(probe, "/health", 503)  # signals are coalesced until handled
                t0 = time.monotonic()
                srv.proc.send_signal(signal.SIGTERM if name == "stopped_twice" else signal.SIGINT)
                try:
                    code = await anyio.to_thread.run_sync(srv.proc.wait, 10)
                finally:
                    took = time.monotonic() - t0
                    tg.cancel_scope.cancel()
    try:
        assert took < 2.0, f"exit took {took:.2f} s"
        assert code == 0
        wait_gone(engine, 1)
    finally:
        if alive(engine):  # a stopped orphan would never exit on its own
            os.kill(engine, signal.SIGKILL)


def pipe_bytes(pid: int) -> int:
    """Bytes waiting in process `pid`'s stdin pipe (FIONREAD on a second descriptor of the same pipe)."""
    import fcntl
    import struct
    import termios

    fd = os.open(f"/proc/{pid}/fd/0", os.O_RDONLY | os.O_NONBLOCK)
    try:
        return int(struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0])
    finally:
        os.close(fd)


# ---- keep-alive, access log, progress --------------------------------------------------------------------


async def test_keepalive_while_queued_and_queue_full_rejected(fleet: dict[str, Launched]) -> None:
    srv = fleet["quiet"].server  # --max-num-seqs 1 --max-num-queued-reqs 1 --sse-keepalive 0.2
    rejected = srv.metric("spindle_requests_rejected_total", 'reason="queue_full"')
    async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
        # long enough to hold the only batch slot until this client lets go of it
        first = {
            "model": "tiny",
            "prompt": "first secret prompt",
            "max_tokens": 900,
            "ignore_eos": True,
            "stream": True,
        }
        async with client.stream("POST", "/v1/completions", json=first) as r1:
            it1 = r1.aiter_text()
            assert "data: {" in await it1.__anext__()  # running: holds the only batch slot
            second = {"model": "tiny", "prompt": "second", "max_tokens": 2, "stream": True}
            async with client.stream("POST", "/v1/completions", json=second) as r2:
                it2 = r2.aiter_text()
                head = await it2.__anext__()  # nothing to say yet: the queue wait is kept alive
                assert head.startswith(": keep-alive\n\n"), head
                third = await client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
                assert third.status_code == 503 and third.headers["retry-after"] == "1"
                await r1.aclose()  # the first client leaves: its request is aborted, the second runs
                rest = head + "".join([t async for t in it2])
            assert events_of(rest)[-1] == "[DONE]" and finishes(events_of(rest)) == ["length"]
    assert srv.metric("spindle_requests_rejected_total", 'reason="queue_full"') - rejected == 1


def wait_log(srv: Server, pattern: str, timeout: float = 10) -> str:
    """The log once it has a line matching `pattern` (the line is written just after the response ends)."""
    deadline = time.monotonic() + timeout
    while not re.search(pattern, log := srv.log.read_text(), re.M):
        assert time.monotonic() < deadline, log[-2000:]
        time.sleep(0.05)
    return log


def test_access_log_one_line_per_request_without_text(fleet: dict[str, Launched]) -> None:
    srv = fleet["quiet"].server
    xid = "ops-log-1"
    r = httpx.post(
        f"{srv.url}/v1/chat/completions",
        headers={"X-Request-Id": xid},
        timeout=60,
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "private words"}],
            "max_tokens": 5,
            "ignore_eos": True,
        },
    )
    assert r.status_code == 200
    bad = httpx.post(f"{srv.url}/v1/completions", json={"model": "tiny", "prompt": "private", "max_tokens": -1})
    assert bad.status_code == 400
    usage = r.json()["usage"]
    pattern = (
        rf'request_id={xid} route="POST /v1/chat/completions" status=200 '
        rf"prompt_tokens={usage['prompt_tokens']} completion_tokens=5 ttft=[\d.]+ duration=[\d.]+ "
        rf"finish_reason=length$"
    )
    wait_log(srv, pattern)
    log = wait_log(srv, r'route="POST /v1/completions" status=400 prompt_tokens=0 completion_tokens=0 ttft=- ')
    assert len(re.findall(rf"request_id={xid} ", log)) == 1
    assert "private" not in log and "secret" not in log  # no prompt text without --log-requests
    # the model load was reported in plain lines (not a terminal)
    assert re.search(r"loading weights: \d+ tensors", log) and "loading weights: done" in log
    assert "\r" not in log


def test_progress_bar_on_a_terminal(fleet: dict[str, Launched]) -> None:
    launched = fleet["sigint"]
    bar = re.compile(r"\rloading weights \[#{30}\] (\d+)/\1 ")  # written before /health turned 200
    wait_until(
        lambda: bar.search(bytes(launched.pty_out).decode(errors="replace")) is not None,
        10,
        lambda: f"the full bar on the terminal: {bytes(launched.pty_out)[-500:]!r}",
    )


def test_sigkill_of_the_server_leaves_no_engine(qwen2_ckpt: Path, tmp_path: Path) -> None:
    srv = start_server(qwen2_ckpt, tmp_path)  # its own: the fleet's servers serve other tests
    engine = srv.engine_pid()
    try:
        srv.proc.kill()
        srv.proc.wait()
        wait_gone(engine, 5)
    finally:
        if alive(engine):
            os.kill(engine, signal.SIGKILL)
