"""Hypercorn's Trio TCP server with a send fast path: one syscall, no lock, no cancel scope, no yield.

Hypercorn's Trio `protocol_send` takes a `trio.Lock`, opens a shielded `CancelScope` and calls
`SocketStream.send_all`, which checkpoints after the syscall: a large share of the API process's busy CPU per
streamed token (bench/README.md, "API CPU per streamed token: the Trio send path"), one SSE event per token per
request. When no other send is in flight on the connection (the lock is free) and the socket takes the whole
chunk at once, as it does unless the client stopped reading, the bytes are written directly and nothing else is
needed; otherwise Hypercorn's own path sends the rest (and handles a broken connection).
`server.http.direct_body.install("trio")` installs it (with connection tracking) for `spindle serve`;
asyncio's writer already writes without yielding. This module is imported by `install()` only (it
subclasses a Hypercorn internal); an unexpected error in the fast path turns it off for the process
(`direct_switch.decline`) and the send goes Hypercorn's way.
"""

from __future__ import annotations

import os
from typing import Any

import trio
from hypercorn.events import Event, RawData
from hypercorn.trio.tcp_server import TCPServer

from server.http import direct_switch


class FastSendTCPServer(TCPServer):
    def write_now(self, data: bytes) -> int:
        """One non-blocking write to the socket: how many bytes it took (0 when full, or broken: then
        Hypercorn's own path waits, or reports the close)."""
        try:
            return os.write(self.stream.socket.fileno(), data)  # a plain SocketStream (callers check)
        except OSError:
            return 0

    async def protocol_send(self, event: Event) -> None:
        stream: Any = self.stream  # Hypercorn annotates it as an SSLStream; plain TCP gives a SocketStream
        if (
            type(event) is RawData
            and direct_switch.is_active()
            and not self.send_lock.locked()
            and type(stream) is trio.SocketStream
        ):
            data = event.data
            try:
                sent = self.write_now(data)
            except Exception as e:  # not OSError (write_now takes those): an unknown layout, nothing was written
                direct_switch.decline(e)
                sent = 0
            if sent == len(data):
                return
            event = RawData(data=data[sent:])
        await super().protocol_send(event)
