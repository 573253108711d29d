"""Streamed body chunks written straight to the connection, under Hypercorn's ASGI and h11 layers.

Each SSE event otherwise travels `send()` -> Hypercorn's HTTPStream -> H11Protocol -> h11's chunked
writer -> TCPServer (lock, write, drain) -> socket, and the route task is woken per event to make
that call. On the demo load that path was about a third of the API process's CPU per token, more
than the socket write itself (`python -m bench.frontend`). Here the output handler, which already
holds the token, frames the HTTP/1.1 chunk itself and writes it, in the same loop over the step's
outputs, without waking the route.

It writes only when that cannot reorder or block: the response was started through ASGI, h11 is
sending a chunked body (not HTTP/1.0, not HTTP/2, not after the end), no other send holds the
connection's lock, and the transport has nothing queued (the client keeps up). Otherwise it
declines and the output goes the ASGI way, where it merges with later ones while the client is
slow. A partial socket write keeps the rest in `pending`, which the route flushes through
Hypercorn's send path before it sends anything else; h11 keeps no state for chunk data, so its
view of the connection stays true.

The writes of one engine step are collected in a `WriteBatch` and made together once the step's
outputs are processed (before the output handler lets any other task run, so nothing can come
between a `send()` and its write): alternating Python and the kernel's TCP path per token kept
both out of the CPU caches (`python -m bench.frontend --worker-class uvloop`: 59 -> 41-46 us of
API CPU per token).

`install()` makes Hypercorn's workers record each connection in a context variable that the
request's tasks inherit; without it (plain `hypercorn ...`), `for_current_request()` is None and
everything goes through ASGI.
"""

from __future__ import annotations

import contextvars
from typing import Any

import h11
import trio
from h11._writers import ChunkedWriter  # h11's writer class for a chunked body: the one framing copied here
from hypercorn.asyncio import run as hypercorn_asyncio_run
from hypercorn.asyncio.tcp_server import TCPServer as AsyncioTCPServer
from hypercorn.events import RawData
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio import run as hypercorn_trio_run
from hypercorn.trio.tcp_server import TCPServer as TrioTCPServer

from server.http.trio_send import FastSendTCPServer

_connection: contextvars.ContextVar[Any] = contextvars.ContextVar("spindle_connection", default=None)


class WriteBatch:
    """Direct writes accepted during one engine step, made by `flush()` before the output handler
    yields to other tasks. One per AsyncLLM (one event loop)."""

    __slots__ = ("_frames",)

    def __init__(self) -> None:
        self._frames: list[tuple[DirectBody, bytes]] = []

    def add(self, body: DirectBody, frame: bytes) -> None:
        self._frames.append((body, frame))

    def flush(self) -> None:
        frames, self._frames = self._frames, []
        for body, frame in frames:
            body._put(frame)


class DirectBody:
    """One response's direct writer, used between the response's start and its last ASGI send (the
    route's streaming loop)."""

    __slots__ = ("_server", "_batch", "_lock", "_chunked", "pending")

    def __init__(self, server: Any, batch: WriteBatch) -> None:
        self._server = server  # Hypercorn's TCPServer of this request's connection
        self._batch = batch
        self._lock = server.send_lock  # held by Hypercorn's own sends
        self._chunked = False  # h11 was seen sending this response's chunked body
        self.pending = b""  # framed bytes a partial write left; flushed before anything else is sent

    def send(self, data: bytes) -> bool:
        """Take `data` as one HTTP/1.1 chunk, written at the batch's flush, if that cannot reorder or
        block; False: it was not taken, send it through ASGI."""
        if self.pending or self._lock.locked() or not self._transport_idle():
            return False
        if not self._chunked:  # once true it stays true until the route's last send: only sends change it
            self._chunked = self._h11_sends_chunks()
            if not self._chunked:
                return False
        if data:
            self._batch.add(self, b"%x\r\n%s\r\n" % (len(data), data))
        return True

    def _h11_sends_chunks(self) -> bool:
        protocol = self._server.protocol.protocol
        if type(protocol) is not H11Protocol:
            return False
        conn = protocol.connection
        return (type(conn) is h11.Connection and conn.our_state is h11.SEND_BODY
                and type(getattr(conn, "_writer", None)) is ChunkedWriter)

    async def flush(self) -> None:
        """Send what a partial write left, through Hypercorn (it waits for the client, or sees it gone)."""
        data, self.pending = self.pending, b""
        if data:
            await self._server.protocol_send(RawData(data=data))

    def _transport_idle(self) -> bool:
        raise NotImplementedError

    def _put(self, frame: bytes) -> None:
        raise NotImplementedError


class _AsyncioBody(DirectBody):
    __slots__ = ("_transport",)

    def __init__(self, server: Any, batch: WriteBatch) -> None:
        super().__init__(server, batch)
        self._transport = server.writer.transport  # one per connection

    def _transport_idle(self) -> bool:
        transport = self._transport
        return transport.get_write_buffer_size() == 0 and not transport.is_closing()

    def _put(self, frame: bytes) -> None:
        if not self._transport.is_closing():  # closed since `send()`: the route's next send sees it
            self._transport.write(frame)  # the transport keeps what the socket did not take


class _TrioBody(DirectBody):
    __slots__ = ()

    def _transport_idle(self) -> bool:
        return type(self._server.stream) is trio.SocketStream  # TLS goes through Hypercorn

    def _put(self, frame: bytes) -> None:
        sent = self._server.write_now(frame)  # the flush through Hypercorn sends the rest, or sees the close
        if sent < len(frame):
            self.pending = frame[sent:]


class _AsyncioServer(AsyncioTCPServer):
    async def run(self) -> None:
        _connection.set((_AsyncioBody, self))
        await super().run()


class _TrioServer(FastSendTCPServer):
    async def run(self) -> None:
        _connection.set((_TrioBody, self))
        await super().run()


def for_current_request(batch: WriteBatch) -> DirectBody | None:
    """A direct writer for the response of the request this task serves, if `install()` ran; its
    writes go out at `batch.flush()`."""
    found = _connection.get()
    return None if found is None else found[0](found[1], batch)


def install(worker_class: str) -> bool:
    """Make Hypercorn's worker record connections (Trio: with its send fast path); False if its
    layout is not the one this module was written against (then nothing changes)."""
    module: Any = hypercorn_trio_run if worker_class == "trio" else hypercorn_asyncio_run
    ours: type = _TrioServer if worker_class == "trio" else _AsyncioServer
    base: type = TrioTCPServer if worker_class == "trio" else AsyncioTCPServer
    current = getattr(module, "TCPServer", None)
    if current is ours:
        return True
    if current is not base or not all(hasattr(base, name) for name in ("run", "protocol_send")):
        return False
    setattr(module, "TCPServer", ours)  # the name the worker looks up per connection
    return True
