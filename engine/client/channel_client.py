"""An API server's client for an engine core it shares with other API servers (`--api-server-count N`).

The launcher (`server/runtime/launcher.py`) starts the engine and gives each API process one end of its own
socketpair; the engine holds the other ends (`engine/transport/channels.py`). This wraps that socket in the usual
`EngineClient`: the same single writer task and queue, the same receive, heartbeat and step timeouts, and
engine death is EOF on the socket. The API process does not own the engine process (`SharedEngine`): leaving
only closes its channel (the engine aborts that channel's requests); the launcher stops the engine.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio.abc

from engine.client.process_client import EngineClient, connect


class SharedEngine:
    """The launcher's engine: this API process never waits for it nor kills it."""

    def __init__(self, pid: int) -> None:
        self._pid = pid

    @property
    def pid(self) -> int:
        return self._pid

    async def exited(self) -> str:
        return f"the engine (pid {self._pid}) closed this API server's channel"

    async def stop(self, grace: float) -> None:
        pass  # the launcher stops the engine once every API process is gone


@asynccontextmanager
async def open_engine_channel(
    fd: int,
    engine_pid: int,
    *,
    ready_timeout: float = 600.0,
    heartbeat_timeout: float = 10.0,
    step_timeout: float = 0.0,
) -> AsyncIterator[EngineClient]:
    """Wait for Ready on channel `fd`, yield an EngineClient over it; close the channel on exit."""
    sock = socket.socket(fileno=fd)
    sock.setblocking(False)
    stream = await anyio.abc.SocketStream.from_socket(sock)
    async with connect(
        stream,
        SharedEngine(engine_pid),
        ready_timeout=ready_timeout,
        heartbeat_timeout=heartbeat_timeout,
        step_timeout=step_timeout,
        shutdown_grace=0.0,
    ) as client:
        yield client
