"""Acceptance 4: a slow reader gets merged, rarer chunks; the server does not buffer per token."""

from __future__ import annotations

import json
import socket
import time

from server.config import ServerConfig
from tests.e2e.conftest import Server


def rss_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


MAX_TOKENS = 1000  # the prompt is 1 token of max_model_len 1024; far more events than the buffers below hold
READ = 2048  # bytes per read, and the client's receive buffer (before the kernel doubles it)
ASYNCIO_HIGH_WATER = 64 << 10  # asyncio transports buffer this much before Hypercorn's drain() waits


def stream(server: Server, slow: bool) -> tuple[list[bytes], int, int]:
    """One streamed completion over a raw socket: (its `data: {...}` lines, the reads made while the engine
    was still generating, the client's receive buffer in bytes). Slow: one read a second until the server
    has processed the last token, then as fast as it comes."""
    body = json.dumps(
        {
            "model": "tiny",
            "prompt": "slow",
            "max_tokens": MAX_TOKENS,
            "ignore_eos": True,
            "temperature": 0.7,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, READ)  # keep the kernel from absorbing the stream
    rcvbuf = s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)  # what the kernel made of it
    finished = server.metric("spindle_request_success_total", 'finished_reason="length"')
    s.connect(("127.0.0.1", server.port))
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body) + body
    )
    data = b""
    slow_reads = 0
    generating = slow
    deadline = time.monotonic() + 120
    while not data.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n") and time.monotonic() < deadline:
        chunk = s.recv(READ)
        if not chunk:
            break
        data += chunk
        if generating:
            slow_reads += 1
            # the server counts the request finished when its last token is processed, whatever the client read
            generating = server.metric("spindle_request_success_total", 'finished_reason="length"') == finished
            if generating:
                time.sleep(1.0)  # the slow client's pace (what is under test, not a synchronization)
    s.close()
    lines = [line for line in data.split(b"\n") if line.startswith(b"data: {")]
    usage = json.loads(lines[-1][6:])["usage"]
    assert usage["completion_tokens"] == MAX_TOKENS
    return lines, slow_reads, rcvbuf


def test_one_chunk_per_second_reader(server: Server) -> None:
    stream(server, slow=False)  # warm-up: a first stream's allocations (caches, arenas) are no leak
    rss_before = rss_kib(server.proc.pid)
    lines, slow_reads, rcvbuf = stream(server, slow=True)
    grown_kib = rss_kib(server.proc.pid) - rss_before
    content = [line for line in lines if b'"choices":[]' not in line]  # the usage chunk has no choice
    # Until the client reads, per-token events fill only what lies between the route and the client: the
    # server's kernel send buffer (--socket-send-buffer, doubled by Linux), the client's receive buffer and,
    # on asyncio, the transport's buffer up to its high-water mark. Once they are full the route waits in its
    # send and outputs merge in the collector: each slow read frees room for at most a couple of (merged)
    # events, and everything generated after the last slow read leaves as one merged event. So the events
    # number at most the buffers' bytes over the smallest event, plus two per slow read, plus the first and
    # last: well under MAX_TOKENS, which a server queueing per token (the reader's pace not merging
    # anything) would send.
    buffered = 2 * ServerConfig().http.socket_send_buffer + rcvbuf
    if "asyncio" in server.args:
        buffered += ASYNCIO_HIGH_WATER
    smallest = min(len(line) + 2 for line in content)  # "data: {...}\n\n"
    bound = buffered // smallest + 2 * slow_reads + 2
    assert bound < MAX_TOKENS * 2 // 3  # the bound leaves room to see a server that does not merge
    assert len(content) <= bound, f"{len(content)} events for {MAX_TOKENS} tokens ({slow_reads} slow reads)"
    # Memory: the stream is bounded by those buffers, so the server's RSS barely moves (measured after a
    # warm-up stream of the same size; about 0.1 MiB here): 2 MiB covers allocator noise, not a server that
    # keeps what it streamed.
    assert grown_kib < 2 * 1024, f"RSS grew {grown_kib} KiB"
