"""--api-server-count 2: two API processes on one socket, one engine core (server/runtime/launcher.py)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import threading
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import start_server
from tests.helpers.processes import alive, children, process_tree, wait_gone, wait_until

ENGINE = "[-]m engine "  # the engine core's command line (pgrep -f)


def _complete(url: str, **body: object) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 16, "ignore_eos": True, **body}, timeout=60
    )


def test_two_api_servers_share_counters_and_limits_and_drain(qwen2_ckpt: Path, tmp_path: Path) -> None:
    srv = start_server(
        qwen2_ckpt,
        tmp_path,
        "--api-server-count",
        "2",
        "--max-num-queued-reqs",
        "3",
        "--log-level",
        "info",
        env={"SPINDLE_LOG_LEVEL": "INFO", "SPINDLE_ENGINE_HEARTBEAT_TIMEOUT": "60"},
    )
    try:
        tree = process_tree(srv.proc.pid)
        assert len(children(srv.proc.pid)) == 3  # the engine core and two API processes

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
            # the 5 over the limit are refused at once; the 3 admitted wait
            wait_until(lambda: sum(f.done() for f in futures) >= 5, 10, "5 of 8 requests answered")
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
            with httpx.stream(
                "POST",
                f"{srv.url}/v1/completions",
                timeout=60,
                json={"prompt": "hi", "max_tokens": 200, "ignore_eos": True, "stream": True},
            ) as r:
                for line in r.iter_lines():
                    chunks.append(line)
                    streaming.set()  # the first token is out: the request is in flight

        reader = threading.Thread(target=stream)
        reader.start()
        assert streaming.wait(30)
        srv.proc.send_signal(signal.SIGTERM)
        reader.join(30)
        assert srv.proc.wait(30) == 0
        assert not reader.is_alive()
        events = [c[6:] for c in chunks if c.startswith("data: ")]
        assert events[-1] == "[DONE]", chunks[-5:]  # the stream ended as streams end, not cut
        bodies = [json.loads(e) for e in events[:-1]]
        assert not [b for b in bodies if "error" in b]  # (the sampled text itself may well hold "error")
        texts = [choice for b in bodies for choice in b["choices"]]
        assert [c["finish_reason"] for c in texts if c["finish_reason"]] == ["length"]  # all 200 tokens
        assert not [p for p in tree if alive(p)]
    finally:
        srv.stop()


def test_engine_death_stops_every_api_server_non_zero(qwen2_ckpt: Path, tmp_path: Path) -> None:
    srv = start_server(qwen2_ckpt, tmp_path, "--api-server-count", "2")
    try:
        tree = process_tree(srv.proc.pid)
        engine = srv.engine_pid()
        os.kill(engine, signal.SIGKILL)
        assert srv.proc.wait(30) != 0
        wait_gone(tree, 10)
    finally:
        srv.stop()


@pytest.mark.parametrize("count", ["0"])
def test_api_server_count_below_one_is_refused(count: str) -> None:
    from server.cli import config_from_args

    with pytest.raises(ValueError, match="--api-server-count must be at least 1"):
        config_from_args(["--api-server-count", count])


def _greedy(url: str, prompt: str) -> str:
    r = httpx.post(
        f"{url}/v1/completions",
        timeout=60,
        json={"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True},
    )
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
    srv = start_server(
        qwen2_ckpt,
        tmp_path,
        "--num-blocks",
        "256",
        "--api-server-count",
        "2",
        "--data-parallel-size",
        "2",
        env={"SPINDLE_ENGINE_HEARTBEAT_TIMEOUT": "60"},
    )
    try:
        tree = process_tree(srv.proc.pid)
        assert len(children(srv.proc.pid, ENGINE)) == 2 and len(children(srv.proc.pid)) == 4  # and 2 API processes
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
        wait_gone(tree, 10)
    finally:
        srv.stop()


def test_one_engine_dying_stops_every_api_server_over_two_engines(qwen2_ckpt: Path, tmp_path: Path) -> None:
    srv = start_server(qwen2_ckpt, tmp_path, "--api-server-count", "2", "--data-parallel-size", "2")
    try:
        tree = process_tree(srv.proc.pid)
        engines = children(srv.proc.pid, ENGINE)
        assert len(engines) == 2
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # a stream in flight (on either engine) fails
            long = pool.submit(
                httpx.post,
                f"{srv.url}/v1/completions",
                timeout=60,
                json={"prompt": "count", "max_tokens": 1000, "ignore_eos": True, "stream": True},
            )
            wait_until(lambda: srv.metric("spindle_num_requests_running") >= 1, 30, "the stream is running")
            os.kill(engines[1], signal.SIGKILL)
            body = long.result().text
        assert "error" in body and "engine" in body, body[-500:]
        assert srv.proc.wait(30) == 1
        wait_gone(tree, 10)  # the other engine and both API processes are gone too
    finally:
        srv.stop()
