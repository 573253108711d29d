"""SSE framing: `data: {json}\n\n` events, `data: [DONE]\n\n` at the end, comment lines as keep-alives."""

from __future__ import annotations

from server.http.errors import APIError

DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keep-alive\n\n"


def frame(payload: bytes) -> bytes:
    """One event carrying one JSON document (msgspec output holds no raw newlines)."""
    return b"data: " + payload + b"\n\n"


def error_frame(error: APIError) -> bytes:
    """An error after streaming began: the status line is gone, so the error travels as an event."""
    return frame(error.body())
