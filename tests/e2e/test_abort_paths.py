"""Acceptance 3 and 5: client disconnects abort their engine requests; engine death reaches every stream."""

from __future__ import annotations

import http.client
import json
import os
import random
import signal
import socket
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
            if (
                server.metric("spindle_num_requests_running") == 0
                and server.metric("spindle_num_requests_waiting") == 0
                and server.metric("spindle_kv_cache_usage_perc") == 0
            ):
                return
            await anyio.sleep(0.05)


async def test_half_of_100_streams_disconnect(server: Server) -> None:
    rng = random.Random(7)
    done: dict[int, list[str]] = {}
    limits = {i: (rng.randrange(1, 20) if i % 2 else None) for i in range(100)}
    aborted_before = server.metric("spindle_request_success_total", 'finished_reason="abort"')

    async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=httpx.Limits(max_connections=200)) as client:

        async def one(i: int) -> None:
            body = {
                "model": "tiny",
                "prompt": f"story {i}",
                "max_tokens": 40 if limits[i] is None else 800,
                "temperature": 0.8,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
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
    saw_finish = sum(
        1 for i, evs in done.items() if limits[i] is not None and any('"finish_reason":"' in e for e in evs)
    )
    await wait_engine_idle(server)
    aborted = server.metric("spindle_request_success_total", 'finished_reason="abort"') - aborted_before
    assert aborted == 50 - saw_finish


async def test_nonstream_disconnect_aborts(server: Server) -> None:
    # n choices of 1000 tokens each (the prompt is 1 token of max_model_len 1024): on CPU this takes many
    # seconds to finish on its own (about 30 s on a 2-core box), far longer than the 2 s the engine gets below
    # to go idle; only the abort the disconnect causes ends it in time.
    n = 16
    await wait_engine_idle(server)  # the shared server runs nothing else: what runs next is this request
    aborted_before = server.metric("spindle_request_success_total", 'finished_reason="abort"')
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                lambda: client.post(
                    "/v1/completions",
                    json={"model": "tiny", "prompt": "x", "n": n, "max_tokens": 1000, "ignore_eos": True},
                )
            )
            with anyio.fail_after(20):  # disconnect once the engine runs every choice (another process: polled)
                while server.metric("spindle_num_requests_running") < n:
                    await anyio.sleep(0.02)
            tg.cancel_scope.cancel()  # the client gives up: its connection closes
    await wait_engine_idle(server, timeout=2)
    aborted = server.metric("spindle_request_success_total", 'finished_reason="abort"') - aborted_before
    assert aborted == n


class HeldRequest:
    """A POST /v1/completions whose body is held back, to see what the server answers at a later moment.

    An engine death stops the CLI at once: the listener closes in the same instant the engine is marked
    dead, so a new /health connection is refused rather than answered 503. But Hypercorn finishes the
    requests it has started (its graceful stop), so a request started before and completed after the death
    is answered then, through `AppState.require`, the check /health makes. `Expect: 100-continue` makes the
    server say when it has parsed the head: from then on the request counts as started.
    """

    BODY = b'{"model": "tiny", "prompt": "x", "max_tokens": 1}'

    def __init__(self, server: Server) -> None:
        self.sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        self.sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(self.BODY)
        )
        head = b""
        while not head.endswith(b"\r\n\r\n"):
            chunk = self.sock.recv(1)
            assert chunk, f"connection closed after {head!r}"
            head += chunk
        assert head.startswith(b"HTTP/1.1 100 "), head

    def finish(self) -> tuple[int, str]:
        """Send the body; the status and body of the answer."""
        try:
            self.sock.sendall(self.BODY)
            response = http.client.HTTPResponse(self.sock)
            response.begin()
            return response.status, response.read().decode()
        finally:
            self.sock.close()


async def test_engine_sigkill_errors_every_stream(qwen2_ckpt: Path, tmp_path: Path) -> None:
    srv = start_server(qwen2_ckpt, tmp_path)
    try:
        engine_pid = srv.engine_pid()
        held = HeldRequest(srv)
        results: dict[int, tuple[float, list[str]]] = {}
        started = anyio.Event()
        n_started = 0
        async with httpx.AsyncClient(base_url=srv.url, timeout=30, limits=httpx.Limits(max_connections=50)) as client:

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
                nonstream.append(
                    await client.post(
                        "/v1/completions", json={"model": "tiny", "prompt": "q", "max_tokens": 900, "ignore_eos": True}
                    )
                )

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
        # while the server winds down, a request it is serving gets 503 (the engine is gone), and it exits
        # non-zero for a supervisor
        status, body = held.finish()
        assert status == 503 and "engine core died" in json.loads(body)["error"]["message"], (status, body)
        assert srv.proc.wait(30) != 0
    finally:
        srv.stop()
