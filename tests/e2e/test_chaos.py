"""Chaos on the real server, bounded for CI: hostile clients, a stopped engine, idle and trickling
connections, a client that stops reading, and SIGTERM in the middle of it all.

Each scenario checks that the server stays healthy, that other work completes, and that the engine's
running / waiting / KV gauges return to 0 afterwards (nothing leaks). Timings in the clients (reset
0-60 ms after sending, the trickle pace) are the hostile behaviour itself, not synchronization.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx
import pytest

from tests.e2e.conftest import Server, start_server
from tests.helpers.processes import wait_gone

pytestmark = pytest.mark.anyio
MAX_LEN = 4096
BIG = 3500  # prompt tokens of the storm's requests


@pytest.fixture
def anyio_backend() -> str:
    return "trio"


@pytest.fixture(scope="module")
def long_ckpt(qwen2_4k_ckpt: Path) -> Path:
    assert MAX_LEN == 4096  # the shared checkpoint's positions
    return qwen2_4k_ckpt


@pytest.fixture(scope="module")
def chaos(long_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(
        long_ckpt, tmp_path_factory.mktemp("chaos"), "--max-model-len", str(MAX_LEN), "--max-num-batched-tokens", "1024"
    )
    yield s
    s.stop()


def _post_bytes(path: str, body: dict[str, object]) -> bytes:
    data = json.dumps(body).encode()
    return (
        b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
        % (path.encode(), len(data))
        + data
    )


def _reset(sock: socket.socket) -> None:
    """Close with RST (SO_LINGER 0), as a client that vanishes does."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


async def vanish(port: int, body: bytes, rng: random.Random, stopping: anyio.Event | None = None) -> None:
    """Send a request and reset the connection 0-60 ms later. Until `stopping` is set, the server must accept the
    connection and take the whole body."""
    try:
        sock = await anyio.connect_tcp("127.0.0.1", port)
    except OSError:
        if stopping is not None and stopping.is_set():  # the server stopped listening: the SIGTERM test's point
            return
        raise
    try:
        await sock.send(body)
        await anyio.sleep(rng.uniform(0, 0.06))
    except (anyio.BrokenResourceError, OSError):
        if stopping is None or not stopping.is_set():
            raise
    finally:
        _reset(sock.extra(anyio.abc.SocketAttribute.raw_socket))
        await sock.aclose()


async def stream_tokens(client: httpx.AsyncClient, max_tokens: int, prompt: str = "keep busy") -> list[str]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    events: list[str] = []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    return events


def finish_reasons(events: list[str]) -> list[str]:
    out = []
    for e in events:
        if e.startswith("{"):
            for c in json.loads(e).get("choices", []):
                if c.get("finish_reason"):
                    out.append(c["finish_reason"])
    return out


async def idle(srv: Server, timeout: float = 60) -> None:
    """Wait until the engine reports nothing running, waiting or held in the KV cache."""
    names = ("spindle_num_requests_running", "spindle_num_requests_waiting", "spindle_kv_cache_usage_perc")
    with anyio.fail_after(timeout):
        while True:
            if all(srv.metric(n) == 0 for n in names):
                return
            await anyio.sleep(0.1)  # the engine reports with its next heartbeat


async def storm(srv: Server, rng: random.Random, clients: int = 24, stopping: anyio.Event | None = None) -> None:
    body = _post_bytes(
        "/v1/completions",
        {"model": "tiny", "prompt": [rng.randrange(100, 150_000) for _ in range(BIG)], "max_tokens": 16},
    )
    async with anyio.create_task_group() as tg:
        for _ in range(clients):
            tg.start_soon(vanish, srv.port, body, rng, stopping)


async def test_big_prompt_disconnect_storm_leaves_the_server_healthy(chaos: Server) -> None:
    rng = random.Random(14)
    aborted_before = chaos.metric("spindle_request_success_total", 'finished_reason="abort"')
    async with httpx.AsyncClient(base_url=chaos.url, timeout=120) as client:
        async with anyio.create_task_group() as tg:
            streams: list[list[str]] = []

            async def long_stream() -> None:
                streams.append(await stream_tokens(client, 64))

            for _ in range(8):
                tg.start_soon(long_stream)
            for _ in range(3):
                await storm(chaos, rng)
        assert [finish_reasons(s) for s in streams] == [["length"]] * 8
        assert (await client.get("/health")).status_code == 200
        normal = await client.post("/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 4})
        assert normal.status_code == 200 and normal.json()["choices"][0]["finish_reason"] == "length"
    assert chaos.proc.poll() is None
    await idle(chaos)
    assert chaos.metric("spindle_request_success_total", 'finished_reason="abort"') > aborted_before


async def test_engine_stopped_for_3s_under_32_streams_then_all_complete(chaos: Server) -> None:
    engine = chaos.engine_pid()
    async with httpx.AsyncClient(base_url=chaos.url, timeout=120, limits=httpx.Limits(max_connections=40)) as client:
        results: list[list[str]] = []
        before = chaos.metric("spindle_num_requests_running")

        async def one() -> None:
            results.append(await stream_tokens(client, 48))

        async with anyio.create_task_group() as tg:
            for _ in range(32):
                tg.start_soon(one)
            with anyio.fail_after(60):  # the fault lands while the streams run (observed from outside)
                while chaos.metric("spindle_num_requests_running") < before + 16:
                    await anyio.sleep(0.05)
            os.kill(engine, signal.SIGSTOP)
            try:
                await anyio.sleep(3)  # the fault itself: a 3 s stall, under the 10 s heartbeat timeout
            finally:
                os.kill(engine, signal.SIGCONT)
    assert [finish_reasons(r) for r in results] == [["length"]] * 32
    await idle(chaos)


async def test_idle_and_trickling_connections_do_not_starve_streams_or_health(chaos: Server) -> None:
    idle_socks: list[socket.socket] = []
    try:
        for _ in range(1000):  # idle keep-alive connections: connected, one request done or none
            s = socket.create_connection(("127.0.0.1", chaos.port))
            idle_socks.append(s)
        async with httpx.AsyncClient(
            base_url=chaos.url, timeout=120, limits=httpx.Limits(max_connections=40)
        ) as client:
            results: list[list[str]] = []
            done = anyio.Event()

            async def trickle(i: int) -> None:
                sock = await anyio.connect_tcp("127.0.0.1", chaos.port)
                async with sock:
                    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Trickle: " + b"a" * 200
                    for byte in head:
                        if done.is_set():
                            return
                        await sock.send(bytes([byte]))
                        await anyio.sleep(0.05)  # the slow-loris pace

            async def one() -> None:
                results.append(await stream_tokens(client, 48))

            probe = start_probe(chaos)  # its own process: this test's event loop must not time itself
            async with anyio.create_task_group() as tg:
                for i in range(50):
                    tg.start_soon(trickle, i)
                async with anyio.create_task_group() as streams:
                    for _ in range(32):
                        streams.start_soon(one)
                done.set()
            latencies = stop_probe(probe)
        assert [finish_reasons(r) for r in results] == [["length"]] * 32
        latencies.sort()
        p99 = latencies[int(len(latencies) * 0.99) - 1]
        assert len(latencies) >= 20 and p99 < 0.05, f"/health p99 {p99 * 1000:.1f} ms over {len(latencies)} probes"
    finally:
        for s in idle_socks:
            s.close()
    await idle(chaos)


PROBE = """
import http.client, json, sys, time, select
conn = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]), timeout=10)
out = []
while not select.select([sys.stdin], [], [], 0.02)[0]:  # until the test closes our stdin
    t0 = time.perf_counter()
    conn.request("GET", "/health")
    r = conn.getresponse()
    r.read()
    out.append((r.status, time.perf_counter() - t0))
print(json.dumps(out))
"""


def start_probe(srv: Server) -> subprocess.Popen[str]:
    """GET /health every 20 ms on one keep-alive connection, from another process."""
    return subprocess.Popen(
        [sys.executable, "-c", PROBE, str(srv.port)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


def stop_probe(probe: subprocess.Popen[str]) -> list[float]:
    out, _ = probe.communicate("", timeout=30)
    answers = json.loads(out)
    assert all(status == 200 for status, _ in answers)
    return [t for _, t in answers]


def rss_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


async def test_a_client_that_stops_reading_costs_no_memory_and_no_latency(chaos: Server) -> None:
    """One stream's reader stops for 60 s; the server's RSS stays flat and the other streams' inter-token
    latency stays what it was without the stalled reader."""
    body = _post_bytes(
        "/v1/completions", {"model": "tiny", "prompt": "stall", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    )
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    stalled.connect(("127.0.0.1", chaos.port))

    async def itl(client: httpx.AsyncClient) -> float:
        """Median gap between a stream's events (seconds) over 4 streams of 40 tokens."""
        gaps: list[float] = []

        async def one() -> None:
            body = {"model": "tiny", "prompt": "measure", "max_tokens": 40, "ignore_eos": True, "stream": True}
            last = None
            async with client.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        now = time.perf_counter()
                        if last is not None:
                            gaps.append(now - last)
                        last = now

        async with anyio.create_task_group() as tg:
            for _ in range(4):
                tg.start_soon(one)
        gaps.sort()
        return gaps[len(gaps) // 2]

    async with httpx.AsyncClient(base_url=chaos.url, timeout=120) as client:
        baseline = await itl(client)
        try:
            stalled.sendall(body)
            assert stalled.recv(1024).startswith(b"HTTP/1.1 200")  # it streams; now it stops reading
            rss0 = rss_kib(chaos.proc.pid)
            samples = []
            t_end = time.monotonic() + 60
            while time.monotonic() < t_end:
                samples.append(await itl(client))
                assert rss_kib(chaos.proc.pid) - rss0 < 16 * 1024, "the server buffers for the stalled reader"
            during = sorted(samples)[len(samples) // 2]
        finally:
            _reset(stalled)
    assert during < max(2 * baseline, baseline + 0.02), f"ITL {baseline * 1000:.1f} -> {during * 1000:.1f} ms"
    await idle(chaos)


async def test_sigterm_during_the_storm_exits_0(long_ckpt: Path, tmp_path: Path) -> None:
    srv = start_server(long_ckpt, tmp_path, "--max-model-len", str(MAX_LEN), "--shutdown-timeout", "3")
    aborted = 'finished_reason="abort"'
    try:
        engine = srv.engine_pid()
        before = srv.metric("spindle_request_success_total", aborted)
        rng = random.Random(15)
        stopping = anyio.Event()  # set just before the SIGTERM: from then on the server may refuse connections
        after = 0  # storms begun once stopping was set

        async def storms() -> None:
            nonlocal after
            while after < 3:  # storming before, during and after the SIGTERM
                after += stopping.is_set()
                await storm(srv, rng, stopping=stopping)

        async with anyio.create_task_group() as tg:
            tg.start_soon(storms)
            with anyio.fail_after(60):  # the storm's requests reached the engine (and were aborted there)
                while await anyio.to_thread.run_sync(srv.metric, "spindle_request_success_total", aborted) <= before:
                    await anyio.sleep(0.05)
            stopping.set()
            srv.proc.send_signal(signal.SIGTERM)
            code = await anyio.to_thread.run_sync(srv.proc.wait, 30)
        assert code == 0
        await anyio.to_thread.run_sync(wait_gone, engine, 5)
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait()
