"""Acceptance 3 and 5: client disconnects abort their engine requests; engine death reaches every stream."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import anyio
import httpx
import pytest

from tests.e2e.conftest import Server, start_server

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def read_events(r: httpx.Response, limit: int | None = None) -> list[str]:
    """Raw SSE payloads; stops early (disconnecting) after `limit` events."""
    out: list[str] = []
    buf = ""
    async for text in r.aiter_text():
        buf += text
        while "\n\n" in buf:
            raw, buf = buf.split("\n\n", 1)
            if raw.startswith("data: "):
                out.append(raw[6:])
            if limit is not None and len(out) >= limit:
                return out
    return out


async def wait_engine_idle(server: Server, timeout: float = 20) -> None:
    with anyio.fail_after(timeout):
        while True:
            if (server.metric("spindle_num_requests_running") == 0
                    and server.metric("spindle_num_requests_waiting") == 0
                    and server.metric("spindle_kv_cache_usage_perc") == 0):
                return
            await anyio.sleep(0.05)


async def test_half_of_100_streams_disconnect(server: Server) -> None:
    rng = random.Random(7)
    done: dict[int, list[str]] = {}
    limits = {i: (rng.randrange(1, 20) if i % 2 else None) for i in range(100)}
    aborted_before = server.metric("spindle_request_success_total", 'finished_reason="abort"')

    async with httpx.AsyncClient(base_url=server.url, timeout=120,
                                 limits=httpx.Limits(max_connections=200)) as client:
        async def one(i: int) -> None:
            body = {"model": "tiny", "prompt": f"story {i}", "max_tokens": 40 if limits[i] is None else 800,
                    "temperature": 0.8,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            async with client.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                done[i] = await read_events(r, limits[i])

        async with anyio.create_task_group() as tg:
            for i in range(100):
                tg.start_soon(one, i)

    for i, evs in done.items():
        if limits[i] is None:
            assert evs[-1] == "[DONE]"
            usage = json.loads(evs[-2])["usage"]
            assert usage["completion_tokens"] == 40
            finishes = [c["finish_reason"] for e in evs[:-1] for c in json.loads(e)["choices"] if c["finish_reason"]]
            assert finishes == ["length"]
    # a disconnecting reader that already saw its finish (merged chunks) was not aborted
    saw_finish = sum(1 for i, evs in done.items() if limits[i] is not None
                     and any('"finish_reason":"' in e for e in evs))
    await wait_engine_idle(server)
    aborted = server.metric("spindle_request_success_total", 'finished_reason="abort"') - aborted_before
    assert aborted == 50 - saw_finish


async def test_nonstream_disconnect_aborts(server: Server) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        with anyio.move_on_after(0.5):
            await client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 900,
                                                       "ignore_eos": True})
    await wait_engine_idle(server)


async def test_engine_sigkill_errors_every_stream(qwen2_ckpt: Path, tmp_path: Path) -> None:
    srv = start_server(qwen2_ckpt, tmp_path)
    try:
        engine_pid = srv.engine_pid()
        results: dict[int, tuple[float, list[str]]] = {}
        started = anyio.Event()
        n_started = 0
        async with httpx.AsyncClient(base_url=srv.url, timeout=30,
                                     limits=httpx.Limits(max_connections=50)) as client:
            async def one(i: int) -> None:
                nonlocal n_started
                body = {"model": "tiny", "prompt": f"p{i}", "max_tokens": 900, "ignore_eos": True, "stream": True}
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    it = r.aiter_text()
                    first = await it.__anext__()
                    n_started += 1
                    if n_started == 20:
                        started.set()
                    rest = first + "".join([t async for t in it])
                    results[i] = (time.monotonic(), [e[6:] for e in rest.split("\n\n") if e.startswith("data: ")])

            nonstream: list[httpx.Response] = []

            async def blocking() -> None:
                nonstream.append(await client.post("/v1/completions", json={
                    "model": "tiny", "prompt": "q", "max_tokens": 900, "ignore_eos": True}))

            async with anyio.create_task_group() as tg:
                tg.start_soon(blocking)
                for i in range(20):
                    tg.start_soon(one, i)
                await started.wait()
                os.kill(engine_pid, signal.SIGKILL)
                killed_at = time.monotonic()
        assert len(results) == 20
        assert nonstream[0].status_code == 500 and "engine" in nonstream[0].json()["error"]["message"]
        for t, evs in results.values():
            assert t - killed_at < 2.0
            assert evs[-1] == "[DONE]" and "error" in json.loads(evs[-2])
        # /health says 503 while the server winds down, then it exits non-zero for a supervisor
        try:
            assert httpx.get(f"{srv.url}/health", timeout=2).status_code == 503
        except httpx.TransportError:
            pass
        assert srv.proc.wait(30) != 0
    finally:
        srv.stop()
