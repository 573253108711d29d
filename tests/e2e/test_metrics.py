"""Issue 6, metrics: /metrics names and labels, exact counters after known workloads, gauges back to 0."""

from __future__ import annotations

import re

import anyio
import httpx
import pytest

from tests.e2e.conftest import Server
from tests.e2e.test_abort_paths import wait_engine_idle

pytestmark = pytest.mark.anyio

HISTOGRAMS = (
    "spindle_time_to_first_token_seconds",
    "spindle_inter_token_latency_seconds",
    "spindle_time_per_output_token_seconds",
    "spindle_e2e_request_latency_seconds",
    "spindle_request_queue_time_seconds",
    "spindle_request_prefill_time_seconds",
    "spindle_request_decode_time_seconds",
)
COUNTERS = (
    "spindle_prompt_tokens_total",
    "spindle_generation_tokens_total",
    "spindle_num_preemptions_total",
    "spindle_prefix_cache_queries_total",
    "spindle_prefix_cache_hits_total",
)
GAUGES = ("spindle_num_requests_running", "spindle_num_requests_waiting", "spindle_kv_cache_usage_perc")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def snapshot(server: Server) -> dict[str, float]:
    """Every sample of /metrics with a model_name label, keyed by name{labels}."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def test_every_metric_is_exported_with_model_name(server: Server) -> None:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    for name in HISTOGRAMS:
        assert re.search(rf'^{name}_bucket{{le="\+Inf",model_name="tiny"}} ', text, re.M), name
        assert re.search(rf'^{name}_count{{model_name="tiny"}} ', text, re.M), name
    for name in COUNTERS + GAUGES:
        assert re.search(rf'^{name}{{model_name="tiny"}} ', text, re.M), name
    for reason in ("stop", "length", "abort", "error"):
        assert f'spindle_request_success_total{{finished_reason="{reason}",model_name="tiny"}}' in text
    for reason in ("queue_full", "shutting_down"):
        assert f'spindle_requests_rejected_total{{model_name="tiny",reason="{reason}"}}' in text


async def test_known_workload_counts_exactly(server: Server) -> None:
    """10 requests x 16 tokens (ignore_eos): +160 generation tokens, +10 requests, one observation each."""
    await wait_engine_idle(server)
    before = snapshot(server)
    usages: list[dict[str, int]] = []
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:

        async def one(i: int) -> None:
            r = await client.post(
                "/v1/completions",
                json={"model": "tiny", "prompt": f"workload {i} says", "max_tokens": 16, "ignore_eos": True},
            )
            assert r.status_code == 200
            usages.append(r.json()["usage"])

        async with anyio.create_task_group() as tg:
            for i in range(10):
                tg.start_soon(one, i)
    await wait_engine_idle(server)
    after = snapshot(server)

    def rose(key: str) -> float:
        return after[key] - before[key]

    m = '{model_name="tiny"}'
    assert rose(f"spindle_generation_tokens_total{m}") == 160
    assert rose(f"spindle_prompt_tokens_total{m}") == sum(u["prompt_tokens"] for u in usages)
    assert rose('spindle_request_success_total{finished_reason="length",model_name="tiny"}') == 10
    for reason in ("stop", "abort", "error"):
        assert rose(f'spindle_request_success_total{{finished_reason="{reason}",model_name="tiny"}}') == 0
    for name in (
        "spindle_time_to_first_token_seconds",
        "spindle_e2e_request_latency_seconds",
        "spindle_time_per_output_token_seconds",
        "spindle_request_queue_time_seconds",
        "spindle_request_prefill_time_seconds",
        "spindle_request_decode_time_seconds",
    ):
        assert rose(f"{name}_count{m}") == 10, name
        assert rose(f"{name}_sum{m}") > 0 or name == "spindle_request_queue_time_seconds", name
    assert rose(f"spindle_inter_token_latency_seconds_count{m}") == 150  # 15 gaps per 16-token request
    # e2e latency covers the decode time of the same requests
    assert rose(f"spindle_e2e_request_latency_seconds_sum{m}") >= rose(f"spindle_request_decode_time_seconds_sum{m}")
    # the prompts were looked up in the prefix cache, token for token
    assert rose(f"spindle_prefix_cache_queries_total{m}") >= sum(u["prompt_tokens"] for u in usages) - 10


async def test_repeated_prompt_hits_prefix_cache(server: Server) -> None:
    prompt = " ".join(f"word{i}" for i in range(40))  # several full KV blocks
    for _ in range(2):
        # the first may already hit: the KV disk store keeps blocks another server of this checkpoint computed
        hits = server.metric("spindle_prefix_cache_hits_total")
        r = httpx.post(
            f"{server.url}/v1/completions", timeout=60, json={"model": "tiny", "prompt": prompt, "max_tokens": 1}
        )
        assert r.status_code == 200
    cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0
    assert server.metric("spindle_prefix_cache_hits_total") - hits == cached


async def test_20_disconnects_count_as_aborts_and_free_everything(server: Server) -> None:
    await wait_engine_idle(server)
    aborted = server.metric("spindle_request_success_total", 'finished_reason="abort"')
    all_running, checked = anyio.Event(), anyio.Event()
    started = 0
    async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=httpx.Limits(max_connections=40)) as client:

        async def one(i: int) -> None:
            nonlocal started
            body = {"model": "tiny", "prompt": f"leave {i}", "max_tokens": 900, "ignore_eos": True, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                it = r.aiter_text()  # held, not abandoned: a collected iterator would close the stream early
                text = ""
                while "data: {" not in text:
                    text += await it.__anext__()
                started += 1
                if started == 20:
                    all_running.set()
                await all_running.wait()  # every stream is generating before any leaves
                if i == 0:  # the gauges see 20 running requests holding KV blocks
                    with anyio.fail_after(20):
                        while not (
                            server.metric("spindle_num_requests_running") == 20
                            and server.metric("spindle_kv_cache_usage_perc") > 0
                        ):
                            await anyio.sleep(0.05)
                    checked.set()
                await checked.wait()
            # leaving the block closes the connection mid-stream

        async with anyio.create_task_group() as tg:
            for i in range(20):
                tg.start_soon(one, i)
    await wait_engine_idle(server)
    assert server.metric("spindle_request_success_total", 'finished_reason="abort"') - aborted == 20
    assert server.metric("spindle_num_requests_running") == 0
    assert server.metric("spindle_kv_cache_usage_perc") == 0
