"""--api-server-count 2: two API processes on one socket, one engine core (server/runtime/launcher.py)."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import start_server



def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def _tree(pid: int) -> list[int]:
    found = []
    for child in _children(pid):
        found += [child, *_tree(child)]
    return found


def _wait_gone(tree: list[int], timeout: float = 10) -> None:
    """Every process of the tree has exited within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while _alive(tree) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(tree)


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        alive.append(pid)
    return alive


def _complete(url: str, **body: object) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 16, "ignore_eos": True, **body},
                      timeout=60)


def test_two_api_servers_share_counters_and_limits_and_drain(qwen2_ckpt: Path, tmp_path: Path) -> None:
    srv = start_server(qwen2_ckpt, tmp_path, "--api-server-count", "2", "--max-num-queued-reqs", "3",
                       "--log-level", "info",
                       env={"SPINDLE_LOG_LEVEL": "INFO", "SPINDLE_ENGINE_HEARTBEAT_TIMEOUT": "60"})
    try:
        tree = _tree(srv.proc.pid)
        assert len(_children(srv.proc.pid)) == 3  # the engine core and two API processes
        for _ in range(4):
            assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200

        # 10 requests x 16 tokens, 3 at a time: they land on both processes; every counter is exact
        before = srv.metric("spindle_generation_tokens_total")
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(lambda _: _complete(srv.url), range(10)))
        assert [r.status_code for r in answers] == [200] * 10
        assert srv.metric("spindle_generation_tokens_total") - before == 160
        assert srv.metric("spindle_request_success_total", 'finished_reason="length"') == 10
        per_process = [srv.metric("spindle_api_server_requests_total", f'api_server="{i}"') for i in (0, 1)]
        assert sum(per_process) == 10 and min(per_process) > 0, per_process
        assert srv.metric("spindle_num_requests_running") == 0  # an engine gauge: once, not summed

        # --max-num-queued-reqs 3 holds for the server as a whole: with the engine stopped no request gets a
        # first token, so of 8 sent at once exactly 3 are admitted, whichever process takes each
        engine = srv.engine_pid()
        os.kill(engine, signal.SIGSTOP)
        try:
            pool = concurrent.futures.ThreadPoolExecutor(8)
            futures = [pool.submit(_complete, srv.url, max_tokens=2) for _ in range(8)]
            deadline = time.monotonic() + 10  # the 5 over the limit are refused at once; the 3 admitted wait
            while sum(f.done() for f in futures) < 5 and time.monotonic() < deadline:
                time.sleep(0.02)
            done = [f for f in futures if f.done()]
            assert len(done) == 5 and all(f.result().status_code == 503 for f in done)
        finally:
            os.kill(engine, signal.SIGCONT)
        assert sorted(f.result().status_code for f in futures) == [200] * 3 + [503] * 5
        pool.shutdown()
        assert srv.metric("spindle_requests_rejected_total", 'reason="queue_full"') == 5

        # SIGTERM: a stream in flight finishes, every process exits, the server exits 0
        chunks: list[str] = []
        streaming = threading.Event()

        def stream() -> None:
            with httpx.stream("POST", f"{srv.url}/v1/completions", timeout=60,
                              json={"prompt": "hi", "max_tokens": 200, "ignore_eos": True, "stream": True}) as r:
                for line in r.iter_lines():
                    chunks.append(line)
                    streaming.set()  # the first token is out: the request is in flight

        reader = threading.Thread(target=stream)
        reader.start()
        assert streaming.wait(30)
        srv.proc.send_signal(signal.SIGTERM)
        reader.join(30)
        assert srv.proc.wait(30) == 0
        assert chunks and chunks[-2:] == ["", "data: [DONE]"] or "data: [DONE]" in chunks
        assert not any("error" in c for c in chunks)
        assert not _alive(tree)
    finally:
        srv.stop()


def test_engine_death_stops_every_api_server_non_zero(qwen2_ckpt: Path, tmp_path: Path) -> None:
    srv = start_server(qwen2_ckpt, tmp_path, "--api-server-count", "2")
    try:
        tree = _tree(srv.proc.pid)
        engine = srv.engine_pid()
        os.kill(engine, signal.SIGKILL)
        assert srv.proc.wait(30) != 0
        _wait_gone(tree)
    finally:
        srv.stop()


@pytest.mark.parametrize("count", ["0"])
def test_api_server_count_below_one_is_refused(count: str) -> None:
    from server.cli import config_from_args

    with pytest.raises(ValueError, match="--api-server-count must be at least 1"):
        config_from_args(["--api-server-count", count])


def _engines(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid), "-f", "[-]m engine "], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def _all_healthy(url: str, times: int = 8, timeout: float = 120) -> None:
    """Every API process serves: `times` health checks in a row answer 200 (each lands on either process)."""
    deadline, ok = time.monotonic() + timeout, 0
    while ok < times and time.monotonic() < deadline:
        ok = ok + 1 if httpx.get(f"{url}/health", timeout=10).status_code == 200 else 0
        time.sleep(0.05 if ok else 0.3)
    assert ok >= times


def _greedy(url: str, prompt: str) -> str:
    r = httpx.post(f"{url}/v1/completions", timeout=60,
                   json={"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


ROUTED = "spindle_engine_requests_routed_total"


def test_two_api_servers_over_two_engines(qwen2_ckpt: Path, tmp_path: Path) -> None:
    """--api-server-count 2 --data-parallel-size 2: each API process pools its channels to both engines."""
    prompts = [f"Request number {i} asks about topic {i * 7}" for i in range(8)]
    one = start_server(qwen2_ckpt, tmp_path, "--num-blocks", "256")
    try:
        expected = [_greedy(one.url, p) for p in prompts]
    finally:
        one.stop()
    srv = start_server(qwen2_ckpt, tmp_path, "--num-blocks", "256", "--api-server-count", "2",
                       "--data-parallel-size", "2", env={"SPINDLE_ENGINE_HEARTBEAT_TIMEOUT": "60"})
    try:
        tree = _tree(srv.proc.pid)
        assert len(_engines(srv.proc.pid)) == 2 and len(_children(srv.proc.pid)) == 4  # 2 engines, 2 API processes
        _all_healthy(srv.url)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda p: _greedy(srv.url, p), prompts))
        assert got == expected
        # routed counts are summed over the API processes: any scrape sees all 8; both engines got work
        routed = [srv.metric(ROUTED, f'engine="{i}"') for i in (0, 1)]
        assert sum(routed) == 8 and min(routed) > 0, routed
        queries = [srv.metric("spindle_engine_prefix_cache_queries_total", f'engine="{i}"') for i in (0, 1)]
        assert min(queries) > 0, queries
        assert srv.metric("spindle_num_requests_running") == 0
        assert srv.metric("spindle_request_success_total") == 8

        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(30) == 0
        _wait_gone(tree)
    finally:
        srv.stop()


def test_one_engine_dying_stops_every_api_server_over_two_engines(qwen2_ckpt: Path, tmp_path: Path) -> None:
    srv = start_server(qwen2_ckpt, tmp_path, "--api-server-count", "2", "--data-parallel-size", "2")
    try:
        tree = _tree(srv.proc.pid)
        engines = _engines(srv.proc.pid)
        assert len(engines) == 2
        _all_healthy(srv.url)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # a stream in flight (on either engine) fails
            long = pool.submit(httpx.post, f"{srv.url}/v1/completions", timeout=60,
                               json={"prompt": "count", "max_tokens": 1000, "ignore_eos": True, "stream": True})
            deadline = time.monotonic() + 30
            while srv.metric("spindle_num_requests_running") < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            os.kill(engines[1], signal.SIGKILL)
            body = long.result().text
        assert "error" in body and "engine" in body, body[-500:]
        assert srv.proc.wait(30) == 1
        deadline = time.monotonic() + 10
        while _alive(tree) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(tree)  # the other engine and both API processes are gone too
    finally:
        srv.stop()
