"""Streamed completions over raw keep-alive sockets: the cheapest client, so it does not bound what it measures."""

from __future__ import annotations

import selectors
import socket
import time
from collections.abc import Callable


def run_raw_streams(
    port: int, concurrency: int, num_requests: int, request: Callable[[int], bytes], on_done: Callable[[bytes], None]
) -> tuple[int, float]:
    """Send `request(i)` for i < num_requests over `concurrency` connections, each waiting for its chunked SSE
    body to end; `on_done(response)` per finished request. Returns (requests ok, seconds)."""
    sel = selectors.DefaultSelector()
    started = done = 0
    bufs: dict[socket.socket, bytearray] = {}

    def start(sock: socket.socket) -> None:
        nonlocal started
        sock.sendall(request(started))
        started += 1
        bufs[sock] = bytearray()

    t0 = time.perf_counter()
    for _ in range(min(concurrency, num_requests)):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setblocking(False)
        sel.register(sock, selectors.EVENT_READ)
        start(sock)
    while done < num_requests:
        for key, _ in sel.select():
            sock = key.fileobj  # type: ignore[assignment]
            data = sock.recv(1 << 16)
            if not data:
                raise SystemExit("the server closed a connection")
            buf = bufs[sock]
            buf += data
            if buf.endswith(b"0\r\n\r\n") and b"data: [DONE]" in buf:  # the chunked body's end
                if b" 200 " not in buf[:16]:
                    raise SystemExit(f"request failed: {bytes(buf[:300])!r}")
                on_done(bytes(buf))
                done += 1
                if started < num_requests:
                    start(sock)
                else:
                    sel.unregister(sock)
                    sock.close()
    return done, time.perf_counter() - t0
