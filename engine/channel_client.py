"""An API server's client for an engine core it shares with other API servers (`--api-server-count N`).

The launcher (`server/runtime/launcher.py`) starts the engine and gives each API process one end of its own
socketpair; the engine holds the other ends (`engine/channels.py`). This wraps that socket in the usual
`EngineClient`: the same single writer task and queue, the same receive, heartbeat and step timeouts, and
engine death is EOF on the socket. The API process does not own the engine process: leaving only closes
its channel (the engine aborts that channel's requests); the launcher stops the engine.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.abc

from engine.client import EngineClient, _wait_ready, running
from engine.ipc import FrameBuffer
from engine.messages import FromEngine


class _ChannelEnd:
    """What EngineClient needs of a `Process`, for a socket: stdin and stdout are the one stream."""

    def __init__(self, stream: anyio.abc.SocketStream, engine_pid: int) -> None:
        self.stdin = stream
        self.stdout = stream
        self.pid = engine_pid
        self.returncode: int | None = 0  # not ours: _shutdown closes the channel and never waits or kills

    async def wait(self) -> int:
        return 0

    def kill(self) -> None:
        pass

    async def aclose(self) -> None:
        await self.stdin.aclose()


@asynccontextmanager
async def open_engine_channel(fd: int, engine_pid: int, *, ready_timeout: float = 600.0,
                              heartbeat_timeout: float = 10.0, step_timeout: float = 0.0
                              ) -> AsyncIterator[EngineClient]:
    """Wait for Ready on channel `fd`, yield an EngineClient over it; close the channel on exit."""
    sock = socket.socket(fileno=fd)
    sock.setblocking(False)
    stream = await anyio.abc.SocketStream.from_socket(sock)
    end = _ChannelEnd(stream, engine_pid)
    frames: FrameBuffer[FromEngine] = FrameBuffer(FromEngine)
    proc: Any = end
    try:
        ready = await _wait_ready(proc, frames, ready_timeout)
    except BaseException:
        with anyio.CancelScope(shield=True):
            await stream.aclose()
        raise
    async with running(EngineClient(proc, ready, frames, heartbeat_timeout, step_timeout), 0.0) as client:
        yield client
