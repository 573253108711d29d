"""--models-dir with --api-server-count N: the messages between the owner of the loaded set (server/fleet/owner.py,
in API process 0) and each API process's registry (server/fleet/follower.py), and the Unix socket they travel on.

Frames are length-prefixed msgpack (engine/transport/ipc.py's codec). `Loaded` carries one file descriptor, the API
process's end of its channel to the new engine, as SCM_RIGHTS ancillary data on the frame's first byte: the reader
queues the descriptors it receives in order and hands one to each `Loaded` it decodes (a descriptor arrives with
or before the last byte of its frame, so it is always queued by then).
"""

from __future__ import annotations

import collections
import os
import socket
from typing import Any

import anyio
import msgspec

from engine.transport.ipc import FrameBuffer, FrameEncoder

# API process -> owner


class Want(msgspec.Struct, frozen=True, tag="want"):
    """A request here waits for `model`: load it if it has no engine (the owner ignores the rest)."""

    model: str


class Activity(msgspec.Struct, frozen=True, tag="activity"):
    """`model` became busy (requests in it or waiting for it, or loading here) or idle in this process."""

    model: str
    busy: bool


class Reply(msgspec.Struct, frozen=True, tag="reply"):
    """The answer to Quiesce: quiet (idle, admitting no more until Resume or Unload) or busy (nothing changed)."""

    model: str
    quiet: bool


class Closed(msgspec.Struct, frozen=True, tag="closed"):
    """After Unload: this process's channel to the model's engine is closed."""

    model: str


class Lost(msgspec.Struct, frozen=True, tag="lost"):
    """This process's own open of the model failed or its channel died unasked: unload it when idle, then reload."""

    model: str
    why: str


class KeepFor(msgspec.Struct, frozen=True, tag="keep"):
    """A request's keep_alive (Ollama's) for `model`: seconds idle before its unload (inf: never; None: the flag's)."""

    model: str
    seconds: float | None


class ListModels(msgspec.Struct, frozen=True, tag="list"):
    ticket: int


# owner -> API process


class Loaded(msgspec.Struct, frozen=True, tag="loaded"):
    """The model's engine is ready; this frame carries this process's channel to it (one fd)."""

    model: str
    pid: int


class Failed(msgspec.Struct, frozen=True, tag="failed"):
    """The model's load failed: the requests waiting for it get a 503 with `why`."""

    model: str
    why: str


class Quiesce(msgspec.Struct, frozen=True, tag="quiesce"):
    model: str


class Resume(msgspec.Struct, frozen=True, tag="resume"):
    model: str


class Unload(msgspec.Struct, frozen=True, tag="unload"):
    model: str


class Listing(msgspec.Struct, frozen=True, tag="listing"):
    ticket: int
    loaded: list[str]


ToOwner = Want | Activity | Reply | Closed | Lost | ListModels | KeepFor
FromOwner = Loaded | Failed | Quiesce | Resume | Unload | Listing


class Control:
    """One end of an owner <-> API process socket: `post` queues a frame (from sync code too), one writer task sends
    them in order; `receive` gives each frame with its descriptor (Loaded) or None at EOF."""

    def __init__(self, fd: int, incoming: Any) -> None:
        self.sock = socket.socket(fileno=fd)
        self.sock.setblocking(False)
        self._frames: FrameBuffer[Any] = FrameBuffer(incoming)
        self._decoded: collections.deque[Any] = collections.deque()
        self._fds: collections.deque[int] = collections.deque()
        self._encoder = FrameEncoder()
        self._send, self._outbox = anyio.create_memory_object_stream[tuple[bytes, int | None]](float("inf"))
        self.eof = False

    def post(self, msg: Any, fd: int | None = None) -> None:
        """Queue `msg` (with `fd`, sent as SCM_RIGHTS and then closed here); dropped once the other end is gone."""
        try:
            if self.eof:
                raise anyio.ClosedResourceError
            self._send.send_nowait((self._encoder.encode(msg), fd))
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):  # gone, or its writer ended (shutdown)
            self.eof = True
            if fd is not None:
                os.close(fd)

    async def run_writer(self) -> None:
        """Send what is posted, in order, until cancelled or the other end is gone."""
        async with self._outbox:
            async for data, fd in self._outbox:
                try:
                    await self._write(data, fd)
                except OSError:
                    self.eof = True
                finally:
                    if fd is not None:
                        os.close(fd)

    async def _write(self, data: bytes, fd: int | None) -> None:
        view = memoryview(data)
        while view:
            await anyio.wait_writable(self.sock)
            try:
                sent = socket.send_fds(self.sock, [view], [fd]) if fd is not None else self.sock.send(view)
            except BlockingIOError:
                continue
            fd = None  # the descriptor went with the first byte
            view = view[sent:]

    async def receive(self) -> tuple[Any, int | None] | None:
        """The next frame and its descriptor; None at EOF (the other process is gone)."""
        while not self._decoded:
            if self.eof:
                return None
            await anyio.wait_readable(self.sock)
            try:
                data, fds, _, _ = socket.recv_fds(self.sock, 1 << 16, 16)
            except BlockingIOError:
                continue
            except OSError:
                data, fds = b"", []
            self._fds.extend(fds)
            if not data:
                self.eof = True
                continue
            self._decoded.extend(self._frames.feed(data))
        msg = self._decoded.popleft()
        return msg, (self._fds.popleft() if isinstance(msg, Loaded) else None)

    def close(self) -> None:
        self.eof = True
        self._send.close()
        while self._fds:
            os.close(self._fds.popleft())
        self.sock.close()
