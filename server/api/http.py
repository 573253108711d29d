"""Raw-ASGI plumbing shared by the routes: bodies, responses, headers, client-disconnect watching."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import anyio

from server.errors import APIError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

JSON = b"application/json"
_JSON_HEADERS = [(b"content-type", JSON)]
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]


class ClientGone(Exception):
    """The client disconnected before the body was read."""


def header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return str(value.decode("latin-1"))
    return None


async def read_body(receive: Receive, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise APIError(f"The request body is larger than {limit} bytes; send a smaller request.", status=413)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def send_json(send: Send, status: int, body: bytes,
                    headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": _JSON_HEADERS + [(b"content-length", str(len(body)).encode())] + (headers or [])})
    await send({"type": "http.response.body", "body": body})


async def send_error(send: Send, error: APIError, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    extra = list(headers or [])
    if error.retry_after is not None:
        extra.append((b"retry-after", str(error.retry_after).encode()))
    await send_json(send, error.status, error.body(), extra)


async def run_until_disconnect(receive: Receive, body: Callable[[], Awaitable[None]]) -> bool:
    """Run `body` in a task group that a client disconnect cancels. Returns False when the client left."""
    left = False
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            nonlocal left
            while (await receive())["type"] != "http.disconnect":
                pass
            left = True
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        await body()
        tg.cancel_scope.cancel()
    return not left
