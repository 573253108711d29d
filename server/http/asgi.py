"""Raw-ASGI plumbing shared by the routes: bodies, responses, headers, client-disconnect watching.

POST bodies are JSON. A request whose Content-Type is set to anything other than `application/json`
(parameters such as `charset` allowed) or a `+json` type gets 415 Unsupported Media Type before its body
is read; a request with no Content-Type at all is read as JSON (curl-style clients often omit it).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, TypeVar

import anyio

from server.http.errors import APIError

T = TypeVar("T")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

JSON = b"application/json"
_JSON_HEADERS = [(b"content-type", JSON)]
SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class ClientGone(Exception):
    """The client disconnected before the body was read."""


def header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return str(value.decode("latin-1"))
    return None


class BodyReader:
    """The request body as it arrives, counted against `limit` (past it, `too_large()` is raised); ClientGone when
    the client goes away first. `more`: whether a piece is still to come."""

    def __init__(self, receive: Receive, limit: int, too_large: Callable[[], APIError]) -> None:
        self.receive = receive
        self.limit = limit
        self.too_large = too_large
        self.size = 0
        self.more = True

    async def next(self) -> bytes:
        message = await self.receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk: bytes = message.get("body", b"")
        self.size += len(chunk)
        if self.size > self.limit:
            raise self.too_large()
        self.more = bool(message.get("more_body", False))
        return chunk


async def read_body(receive: Receive, limit: int) -> bytes:
    reader = BodyReader(
        receive,
        limit,
        lambda: APIError(f"The request body is larger than {limit} bytes; send a smaller request.", status=413),
    )
    chunks: list[bytes] = []
    while reader.more:
        chunks.append(await reader.next())
    return b"".join(chunks)


def check_content_type(scope: Scope) -> None:
    """415 unless the body is declared JSON (or not declared at all); see the module docstring."""
    value = header(scope, b"content-type")
    if value is None:
        return
    media = value.split(";", 1)[0].strip().lower()
    if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
        return
    raise APIError(
        f"Content-Type {media or value!r} is not supported; send the body as JSON with "
        "`Content-Type: application/json`.",
        status=415,
    )


async def read_json_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The body of a JSON POST: 415 for a non-JSON Content-Type, 413 beyond `limit` bytes."""
    check_content_type(scope)
    return await read_body(receive, limit)


async def send_json(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": _JSON_HEADERS + [(b"content-length", str(len(body)).encode())] + (headers or []),
        }
    )
    await send({"type": "http.response.body", "body": body})


async def send_error(send: Send, error: APIError, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    extra = list(headers or [])
    if error.retry_after is not None:
        extra.append((b"retry-after", str(error.retry_after).encode()))
    await send_json(send, error.status, error.body(), extra)


def no_route(see: str) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    """A router's default endpoint: 404 naming the method and path, then `see` (where to look instead)."""

    async def not_found(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        await send_error(send, APIError(f"No route {scope.get('method')} {scope['path']}{see}", status=404))

    return not_found


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


async def serve_json_post(
    scope: Scope,
    receive: Receive,
    send: Send,
    limit: int,
    work: Callable[[bytes], Awaitable[None]],
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    """Read a JSON body (415/413 as errors), then run `work(body)` until it ends or the client leaves.

    An APIError raised by `work` before it sent a response becomes the error response (with `headers`).
    """

    async def error(send: Send, e: APIError) -> None:
        await send_error(send, e, headers)

    await serve_post(receive, send, lambda: read_json_body(scope, receive, limit), work, error)


async def serve_post(
    receive: Receive,
    send: Send,
    read: Callable[[], Awaitable[T]],
    work: Callable[[T], Awaitable[None]],
    error: Callable[[Send, APIError], Awaitable[None]],
) -> None:
    """`read()` the request (its APIError answered by `error`; a client gone ends it), then run `work` on what it
    read until it ends or the client leaves; an APIError `work` raises before it sent a response goes to `error`
    (each API family answers errors in its own shape)."""
    try:
        got = await read()
    except ClientGone:
        return
    except APIError as e:
        await error(send, e)
        return

    async def guarded() -> None:
        try:
            await work(got)
        except APIError as e:
            await error(send, e)

    await run_until_disconnect(receive, guarded)
