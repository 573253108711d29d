"""Streamed body chunks written straight to the connection, under Hypercorn's ASGI and h11 layers.

Each SSE event otherwise travels `send()` -> Hypercorn's HTTPStream -> H11Protocol -> h11's chunked writer ->
TCPServer (lock, write, drain) -> socket, and the route task is woken per event to make that call. On the demo
load that path cost more of the API process's CPU per token than the socket write itself (bench/README.md,
"API CPU per streamed token: the direct write path"). Here the output handler, which already holds the token,
frames the HTTP/1.1 chunk itself and queues it for the writer task, without waking the route.

It writes only when that cannot reorder or block: the response was started through ASGI, h11 is
sending a chunked body (not HTTP/1.0, not HTTP/2, not after the end), no other send holds the
connection's lock, and the transport has nothing queued (the client keeps up). Otherwise it
declines and the output goes the ASGI way, where it merges with later ones while the client is
slow. A partial socket write keeps the rest in `pending`, which the route flushes through
Hypercorn's send path before it sends anything else; h11 keeps no state for chunk data, so its
view of the connection stays true.

The writes of one engine step are collected in a `WriteBatch` and made together by its writer task,
which the step's first write wakes and which runs once the output handler yields: alternating Python and the
kernel's TCP path per token kept both out of the CPU caches (bench/README.md, "API CPU per streamed token: the
direct write path"). A route that sends through ASGI first writes what its response still has queued
(`DirectBody.flush`), so the writer running before or after it changes no order.

The pipeline knows none of this: the route's responder gives the request's collector a waiter
(server/http/wakeup.py's `InlineWaiter`) whose wake-up, in the output handler, formats the new output and
offers it to `DirectBody.send`, and wakes the route only when that declines.

`install()` makes Hypercorn's workers record each connection in a context variable that the
request's tasks inherit; without it (plain `hypercorn ...`), `for_current_request()` is None and
everything goes through ASGI.

Fail-safe: the private Hypercorn and h11 names are looked up in `install()` only, which declines
(changes nothing) if one is missing or differently shaped, or with `SPINDLE_DIRECT_WRITE=0`. An
exception while using the fast path at request time turns it off for the process (one warning; the switch,
shared with the Trio send path, is server/http/direct_switch.py); the output that met it, and every later
one, goes through ASGI. Those private names are why pyproject.toml pins Hypercorn and h11; what the path saves
is in bench/README.md, "API CPU per streamed token: the direct write path on and off".
"""

from __future__ import annotations

import contextvars
import logging
from dataclasses import dataclass
from typing import Any

import anyio
import h11
import trio

from server.config import ServerEnv
from server.http.direct_switch import decline, is_active
from server.http.wakeup import Waiter, waiter_class

log = logging.getLogger("spindle.server")

_connection: contextvars.ContextVar[Any] = contextvars.ContextVar("spindle_connection", default=None)


@dataclass(frozen=True, slots=True)
class _Layout:
    """The Hypercorn, h11 and Trio classes the fast path checks against, found by `install()`."""

    # Any: `type(x) is ...` must not narrow x
    h11_protocol: Any
    connection: Any
    send_body: Any
    chunked_writer: Any
    raw_data: Any
    socket_stream: Any


_layout: _Layout | None = None  # set by a successful install()
_servers: dict[str, type] = {}  # worker class -> our TCPServer subclass, made once (install() is idempotent)
_writes: WriteBatch | None = None  # the serving process's batch, given to install() (serve() runs its writer)


def _frame(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class WriteBatch:
    """The responses with direct writes queued since the last `flush()`; `run()` is the writer task that
    flushes once per wake-up (the first queued response of a step wakes it). One per serving event loop."""

    __slots__ = ("_bodies", "_waiter", "_scope", "_stopped")

    def __init__(self) -> None:
        self._bodies: list[DirectBody] = []
        self._waiter: Waiter | None = None  # the writer task's, while it runs
        self._scope: anyio.CancelScope | None = None
        self._stopped = False

    @property
    def running(self) -> bool:
        return self._waiter is not None

    def add(self, body: DirectBody) -> None:
        self._bodies.append(body)
        if len(self._bodies) == 1 and self._waiter is not None:
            self._waiter.wake()

    def flush(self) -> None:
        bodies, self._bodies = self._bodies, []
        for body in bodies:
            body.write_queued()

    async def run(self) -> None:
        """The writer task, until `stop()` (called before it started: it does not start)."""
        with anyio.CancelScope() as self._scope:
            if self._stopped:
                return
            self._waiter = waiter_class()()
            try:
                while True:
                    await self._waiter.wait()
                    self.flush()
            finally:
                self._waiter = None
                self.flush()  # what routes queued last goes out (a closed connection declines it)

    def stop(self) -> None:
        self._stopped = True
        if self._scope is not None:
            self._scope.cancel()


class DirectBody:
    """One response's direct writer, used between the response's start and its last ASGI send (the
    route's streaming loop)."""

    __slots__ = ("_server", "_batch", "_lock", "_chunked", "_queued", "pending")

    def __init__(self, server: Any, batch: WriteBatch) -> None:
        self.pending = b""  # framed bytes a partial write left; flushed before anything else is sent
        self._server = server  # Hypercorn's TCPServer of this request's connection
        self._batch = batch
        self._queued: list[bytes] = []  # frames taken by `send`, not yet written
        self._lock = server.send_lock  # held by Hypercorn's own sends
        self._chunked = False  # h11 was seen sending this response's chunked body

    def send(self, data: bytes) -> bool:
        """Take `data` as one HTTP/1.1 chunk, written by the batch's writer (or by `flush`, whichever
        comes first), if that cannot reorder or block; False: it was not taken, send it through ASGI."""
        if not is_active():
            return False
        if self._queued:  # the writer has not run since this response's last chunk: write that one now, so
            self.write_queued()  # a full socket shows at once (`pending`) and the route merges what follows
        try:
            if self.pending or self._lock.locked() or not self._transport_idle():
                return False
            if not self._chunked:  # once true it stays true until the route's last send: only sends change it
                self._chunked = self._h11_sends_chunks()
                if not self._chunked:
                    return False
        except Exception as e:  # runs in the output handler: an unknown layout declines, never raises
            decline(e)
            return False
        if data:
            queued = self._queued
            queued.append(b"%x\r\n%s\r\n" % (len(data), data))  # _frame(), inline: once per token
            if len(queued) == 1:
                self._batch.add(self)
        return True

    def write_queued(self) -> None:
        """Write the frames `send` took; a failed write leaves them in `pending` (Hypercorn's path sends them)."""
        queued = self._queued
        if not queued:
            return
        data = queued[0] if len(queued) == 1 else b"".join(queued)
        queued.clear()
        try:
            self._put(data)
        except Exception as e:  # runs in the writer task: a failed write must not end it
            decline(e)
            self.pending += data  # the route sends it through Hypercorn before anything else

    def _h11_sends_chunks(self) -> bool:
        layout = _layout
        protocol = self._server.protocol.protocol
        if layout is None or type(protocol) is not layout.h11_protocol:
            return False
        conn = protocol.connection
        return (
            type(conn) is layout.connection
            and conn.our_state is layout.send_body
            and type(conn._writer) is layout.chunked_writer
        )

    async def flush(self) -> None:
        """Before an ASGI send: the queued frames, then what a partial write left, through Hypercorn (it
        waits for the client, or sees it gone)."""
        self.write_queued()
        data, self.pending = self.pending, b""
        if data:
            assert _layout is not None  # pending is only ever set on a body made after install()
            await self._server.protocol_send(_layout.raw_data(data=data))

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
        if self.pending:  # an earlier frame is still waiting for Hypercorn's path: keep the order
            self.pending += frame
        elif not self._transport.is_closing():  # closed since `send()`: the route's next send sees it
            self._transport.write(frame)  # the transport keeps what the socket did not take


class _TrioBody(DirectBody):
    __slots__ = ()

    def _transport_idle(self) -> bool:
        layout = _layout
        return layout is not None and type(self._server.stream) is layout.socket_stream  # TLS: Hypercorn's path

    def _put(self, frame: bytes) -> None:
        if self.pending:  # an earlier frame is still waiting for Hypercorn's path: keep the order
            self.pending += frame
            return
        sent = self._server.write_now(frame)  # the flush through Hypercorn sends the rest, or sees the close
        if sent < len(frame):
            self.pending = frame[sent:]


def for_current_request(batch: WriteBatch | None = None) -> DirectBody | None:
    """A direct writer for the response of the request this task serves, if `install()` ran and the
    fast path is on; its writes go out at `batch.flush()` (None: install()'s batch, if its writer runs)."""
    found = _connection.get()
    if batch is None:
        batch = _writes if _writes is not None and _writes.running else None
    if found is None or batch is None or not is_active():
        return None
    try:
        body: DirectBody = found[0](found[1], batch)
    except Exception as e:  # a server object without the attributes this module expects
        decline(e)
        return None
    return body


def _find_layout(worker_class: str) -> tuple[Any, type, type, _Layout]:
    """(Hypercorn's run module, its TCPServer class, our subclass of it, the layout); raises if the
    installed Hypercorn or h11 is not shaped as this module expects."""
    # Private modules, imported here so that a Hypercorn or h11 without them makes install() decline.
    from h11._writers import ChunkedWriter  # h11's writer class for a chunked body: the one framing copied here
    from hypercorn.events import RawData
    from hypercorn.protocol.h11 import H11Protocol

    parts: list[bytes] = []
    ChunkedWriter().send_data(b"abc", parts.append)
    if b"".join(parts) != _frame(b"abc"):
        raise TypeError("h11's chunk framing differs from ours")
    if not hasattr(h11.Connection(h11.SERVER), "_writer"):
        raise AttributeError("h11.Connection has no _writer")
    module: Any  # Hypercorn's run module of the worker class, whose TCPServer name install() replaces
    base: type  # its TCPServer
    ours_base: type  # what our connection-recording class subclasses
    body: type[DirectBody]
    socket_stream: type | None = None
    if worker_class == "trio":
        # Private too (and trio_send subclasses Hypercorn's TCPServer when imported): loaded on install only.
        from hypercorn.trio import run as trio_run
        from hypercorn.trio.tcp_server import TCPServer as TrioTCPServer

        from server.http.trio_send import FastSendTCPServer

        module, base, ours_base, body = trio_run, TrioTCPServer, FastSendTCPServer, _TrioBody
        socket_stream = trio.SocketStream
        if not issubclass(FastSendTCPServer, base):
            raise TypeError("server.http.trio_send was built on another TCPServer")
    else:
        # Private, loaded on install only (as above).
        from hypercorn.asyncio import run as asyncio_run
        from hypercorn.asyncio.tcp_server import TCPServer as AsyncioTCPServer

        module, base, ours_base, body = asyncio_run, AsyncioTCPServer, AsyncioTCPServer, _AsyncioBody
    for name in ("run", "protocol_send"):
        if not callable(getattr(base, name, None)):
            raise AttributeError(f"Hypercorn's {worker_class} TCPServer has no {name}()")
    ours = _servers.get(worker_class)
    if ours is None:
        ours = _servers[worker_class] = _server_class(ours_base, body)
    layout = _Layout(H11Protocol, h11.Connection, h11.SEND_BODY, ChunkedWriter, RawData, socket_stream)
    return module, base, ours, layout


def _server_class(base: type, body: type[DirectBody]) -> type:
    """`base` (Trio: our FastSendTCPServer; asyncio: Hypercorn's TCPServer) recording each connection with
    the direct writer class for it."""

    class _Server(base):  # type: ignore[misc]  # a class found at run time
        async def run(self) -> None:
            _connection.set((body, self))
            await super().run()

    return _Server


def install(worker_class: str, writes: WriteBatch | None = None) -> bool:
    """Make Hypercorn's worker record connections (Trio: with its send fast path); False, with the
    reason logged, if SPINDLE_DIRECT_WRITE=0 or the layout is not the one this module was written
    against (then nothing changes). `writes`: the batch `for_current_request()` uses by default; the
    caller runs its writer task."""
    global _layout, _writes
    if not ServerEnv.read().direct_write:
        log.info("SPINDLE_DIRECT_WRITE=0: streaming through ASGI only")
        return False
    try:
        module, base, ours, layout = _find_layout(worker_class)
    except Exception as e:  # ImportError, AttributeError, ...: an unknown Hypercorn or h11
        log.warning(
            "this Hypercorn's %s worker or h11 has an unknown layout (%s: %s): streaming through ASGI only",
            worker_class,
            type(e).__name__,
            e,
        )
        return False
    current = getattr(module, "TCPServer", None)
    if current is not ours and current is not base:
        log.warning(
            "Hypercorn's %s worker runs another TCPServer (%r): streaming through ASGI only", worker_class, current
        )
        return False
    _layout, _writes = layout, writes
    setattr(module, "TCPServer", ours)  # the name the worker looks up per connection
    return True
