"""The real server with --tensor-parallel-size 2: it serves, and a SIGKILLed rank 1 fails the stream in flight,
stops the server with a non-zero exit, and leaves no engine process behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx

from tests.e2e.conftest import start_server
from tests.helpers.processes import alive, wait_gone


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_killed_rank_fails_requests_and_stops_the_server(qwen2_ckpt: Path, tmp_path: Path) -> None:
    srv = start_server(qwen2_ckpt, tmp_path, "--tensor-parallel-size", "2")
    engine = srv.engine_pid()
    ranks = children(engine)
    try:
        assert len(ranks) == 1, ranks
        r = httpx.post(
            f"{srv.url}/v1/completions",
            timeout=30,
            json={"model": "tiny", "prompt": "hello", "max_tokens": 4, "ignore_eos": True},
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        body = {"model": "tiny", "prompt": "keep busy", "max_tokens": 900, "ignore_eos": True, "stream": True}
        events: list[str] = []
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=30) as resp:
            assert resp.status_code == 200
            killed = 0.0
            try:
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                    if len(events) == 3 and not killed:  # mid-stream: tokens are flowing
                        os.kill(ranks[0], signal.SIGKILL)
                        killed = time.monotonic()
            except httpx.HTTPError:
                pass  # the server may cut the connection instead of sending an error event
        finished = [
            c.get("finish_reason") for e in events if e.startswith("{") for c in json.loads(e).get("choices", [])
        ]
        assert "length" not in finished, "the stream finished normally although rank 1 was killed"
        assert any(e.startswith("{") and "error" in json.loads(e) for e in events) or events[-1] != "[DONE]"
        assert srv.proc.wait(30) != 0
        assert time.monotonic() - killed < 30
        wait_gone(engine, 10)
        wait_gone(ranks[0], 10)
        log = srv.log.read_text()
        assert "tensor-parallel rank 1" in log and "signal 9" in log, log[-2000:]
    finally:
        srv.stop()
        for pid in (engine, *ranks):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_stopped_rank_times_out_the_step_and_is_killed(qwen2_ckpt: Path, tmp_path: Path) -> None:
    """SIGSTOP: rank 1 lives but never answers; the step's collective times out (3 s here), rank 0 exits 1
    and SIGKILLs it, so no stopped rank is left behind."""
    srv = start_server(qwen2_ckpt, tmp_path, "--tensor-parallel-size", "2", env={"SPINDLE_DISTRIBUTED_TIMEOUT": "3"})
    engine = srv.engine_pid()
    ranks = children(engine)
    try:
        os.kill(ranks[0], signal.SIGSTOP)
        stopped = time.monotonic()
        r = httpx.post(
            f"{srv.url}/v1/completions",
            timeout=60,
            json={"model": "tiny", "prompt": "hello", "max_tokens": 4, "ignore_eos": True},
        )
        assert r.status_code >= 500, r.text
        assert srv.proc.wait(30) != 0
        assert time.monotonic() - stopped < 30
        wait_gone(engine, 10)
        wait_gone(ranks[0], 10)
        assert "no rank of this node exited" in srv.log.read_text()
    finally:
        srv.stop()
        for pid in (engine, *ranks):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_headless_node_serves_and_exits_0_when_the_server_stops(qwen2_ckpt: Path, tmp_path: Path) -> None:
    """Two "nodes" on 127.0.0.1: node 1 runs `python -m server --headless`; SIGTERM on node 0 stops node 1 cleanly
    (rank 0 sends its stop plan before the engine exits), not by a broken group."""
    import socket
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    node1 = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "server",
            "--headless",
            "--tensor-parallel-size",
            "2",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            port,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    srv = start_server(
        qwen2_ckpt,
        tmp_path,
        "--tensor-parallel-size",
        "2",
        "--nnodes",
        "2",
        "--node-rank",
        "0",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        port,
    )
    try:
        r = httpx.post(
            f"{srv.url}/v1/completions",
            timeout=30,
            json={"model": "tiny", "prompt": "hello", "max_tokens": 4, "ignore_eos": True},
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        assert srv.stop() == 0
        assert node1.wait(20) == 0, (node1.stderr.read() if node1.stderr else b"")[-2000:]
    finally:
        srv.stop()
        if node1.poll() is None:
            node1.kill()
            node1.wait()
