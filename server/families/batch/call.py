"""One batch line through the online route's own endpoint, in process: a POST with its body, as a client would
send it, and the status and body it answers."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from server.http.asgi import Message

Endpoint = Callable[
    [dict[str, Any], Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]
]


async def call(endpoint: Endpoint, path: str, body: bytes, request_id: str) -> tuple[int, Any]:
    """(status, decoded JSON body) of POST `path` with `body` answered by `endpoint`."""
    scope: dict[str, Any] = {
        "type": "http",
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"x-request-id", request_id.encode())],
        "path_params": {},
    }
    delivered = False
    status = 500
    chunks: list[bytes] = []

    async def receive() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await anyio.sleep_forever()  # no client to leave: the route's disconnect watcher waits until cancelled
        raise AssertionError("unreachable")

    async def send(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = int(message["status"])
        elif message["type"] == "http.response.body":
            chunks.append(bytes(message.get("body", b"")))

    await endpoint(scope, receive, send)
    raw = b"".join(chunks)
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, {"error": {"message": raw.decode("utf-8", "replace"), "type": "server_error", "code": status}}
