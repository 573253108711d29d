"""Acceptance 4: a slow reader gets merged, rarer chunks; the server does not buffer per token."""

from __future__ import annotations

import json
import socket
import time

from tests.e2e.conftest import Server


def rss_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_one_chunk_per_second_reader(server: Server) -> None:
    body = json.dumps({"model": "tiny", "prompt": "slow", "max_tokens": 500, "ignore_eos": True,
                       "temperature": 0.7, "stream": True, "stream_options": {"include_usage": True}}).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)  # keep the kernel from absorbing the stream
    s.connect(("127.0.0.1", server.port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    rss_before = rss_kib(server.proc.pid)
    data = b""
    t0 = time.monotonic()
    deadline = t0 + 90
    while not data.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n") and time.monotonic() < deadline:
        chunk = s.recv(2048)
        if not chunk:
            break
        data += chunk
        time.sleep(1.0 if time.monotonic() - t0 < 5 else 0.01)  # one read a second while it generates
    s.close()
    text = data.decode()
    payloads = [line[6:] for line in text.split("\n") if line.startswith("data: {")]
    chunks = [json.loads(p) for p in payloads]
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == 500
    content_events = [c for c in chunks if c["choices"]]
    assert len(content_events) < 500, "outputs were not merged for the slow reader"
    assert rss_kib(server.proc.pid) - rss_before < 50 * 1024
