"""Issue 17, data parallel: `--data-parallel-size 2` on the tiny checkpoint against the one-engine server."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import Server, start_server
from tests.helpers.processes import children, wait_gone, wait_until

ROUTED = "spindle_engine_requests_routed_total"
HITS = "spindle_engine_prefix_cache_hits_total"


@pytest.fixture(scope="module")
def servers(qwen2_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server]]:
    tmp = tmp_path_factory.mktemp("dp")
    one = start_server(qwen2_ckpt, tmp, "--num-blocks", "256")
    try:
        two = start_server(qwen2_ckpt, tmp, "--num-blocks", "256", "--data-parallel-size", "2")
    except BaseException:
        one.stop()
        raise
    yield one, two
    one.stop()
    two.stop()


def complete(server: Server, prompt: str, **extra: Any) -> list[str]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **extra}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]


def routed(server: Server) -> list[float]:
    return [server.metric(ROUTED, f'engine="{i}"') for i in range(2)]


def test_both_engines_work_and_greedy_outputs_match_one_engine(servers: tuple[Server, Server]) -> None:
    one, two = servers
    prompts = [f"Request number {i} asks about topic {i * 7}" for i in range(6)]
    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(lambda p: complete(two, p), prompts))
    assert got == [complete(one, p) for p in prompts]
    assert min(routed(two)) >= 1, routed(two)
    assert two.metric("spindle_num_requests_running") == 0  # the sum over engines, back to idle


def test_same_prefix_lands_on_one_engine_and_hits_its_cache(servers: tuple[Server, Server]) -> None:
    _, two = servers
    prefix = "You are a careful assistant who answers in full sentences. " * 12
    before, hits_before = routed(two), [two.metric(HITS, f'engine="{i}"') for i in range(2)]
    for i in range(4):  # one at a time: idle engines tie, so without affinity these would alternate
        complete(two, prefix + f"Question {i}?")
    delta = [a - b for a, b in zip(routed(two), before)]
    assert sorted(delta) == [0, 4], delta
    engine = delta.index(4)
    assert two.metric(HITS, f'engine="{engine}"') - hits_before[engine] >= 3 * 16 * 3  # 3 repeats, blocks each


def test_n_children_stay_on_one_engine(servers: tuple[Server, Server]) -> None:
    one, two = servers
    before = routed(two)
    texts = complete(two, "Tell me a story about a lighthouse", n=3)
    delta = sorted(a - b for a, b in zip(routed(two), before))
    assert delta == [0, 3]
    assert texts == complete(one, "Tell me a story about a lighthouse") * 3


def test_killing_one_engine_fails_requests_and_exits_non_zero(qwen2_ckpt: Path, tmp_path: Path) -> None:
    """The rule: a dead engine is a dead server; with several, any one of them. (Its own server: it ends it.)"""
    two = start_server(qwen2_ckpt, tmp_path, "--num-blocks", "256", "--data-parallel-size", "2")
    try:
        pids = children(two.proc.pid, "[-]m engine ")
        assert len(pids) == 2, pids
        with ThreadPoolExecutor(1) as pool:
            long = pool.submit(
                httpx.post,
                f"{two.url}/v1/completions",
                timeout=60,
                json={"model": "tiny", "prompt": "count", "max_tokens": 1000, "ignore_eos": True, "stream": True},
            )
            wait_until(lambda: two.metric("spindle_num_requests_running") >= 1, 30, "the stream is running")
            os.kill(pids[1], signal.SIGKILL)
            body = long.result().text
        assert "error" in body and "engine" in body, body[-500:]
        assert two.proc.wait(30) == 1
        wait_gone(pids[0], 10)  # the other engine is stopped with the server
    finally:
        two.stop()
