"""The API server's side of the engine: start the subprocess, send requests, receive step frames.

Works on any anyio backend (Trio, asyncio, uvloop): the pipes are anyio process streams, read
without a thread. Engine death (EOF, exit, silence past the heartbeat timeout) is an
`EngineDeadError` from `receive`, never a hang.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
from anyio.abc import Process

from engine.config import EngineConfig
from engine.ipc import FrameBuffer, FrameEncoder, FrameError
from engine.messages import (
    AbortRequests, AddRequest, EngineStats, FromEngine, Heartbeat, LoadFailed, Ready, Shutdown,
    StepOutputs, ToEngine,
)


class EngineDeadError(RuntimeError):
    """The engine process is gone or silent; every in-flight request must fail."""


class EngineLoadError(RuntimeError):
    """The engine could not start serving (the model failed to load); the message says why."""


class EngineClient:
    def __init__(self, process: Process, ready: Ready, frames: FrameBuffer[FromEngine],
                 heartbeat_timeout: float) -> None:
        self._process = process
        assert process.stdin is not None and process.stdout is not None
        self._stdin = process.stdin
        self._stdout = process.stdout
        self._frames = frames
        self._pending: deque[FromEngine] = deque()
        self._encoder = FrameEncoder()
        self._send_lock = anyio.Lock()  # one writer at a time keeps frames whole
        self._heartbeat_timeout = heartbeat_timeout
        self.ready = ready
        self.stats = EngineStats(0, 0, 0, ready.num_blocks, 0, 0, 0)
        self.dead: EngineDeadError | None = None

    @property
    def pid(self) -> int:
        return self._process.pid

    async def add_request(self, req: AddRequest) -> None:
        await self._send(req)

    async def abort(self, request_ids: list[str]) -> None:
        if request_ids and self.dead is None:
            await self._send(AbortRequests(request_ids))

    async def _send(self, msg: ToEngine) -> None:
        if self.dead is not None:
            raise self.dead
        data = self._encoder.encode(msg)
        try:
            async with self._send_lock:
                await self._stdin.send(data)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as e:
            raise self._die(f"the engine process stopped reading its pipe ({e!r})") from e

    async def receive(self) -> StepOutputs | Heartbeat:
        """The next frame; call it from one task only."""
        while not self._pending:
            if self.dead is not None:
                raise self.dead
            chunk = b""
            with anyio.move_on_after(self._heartbeat_timeout):
                try:
                    chunk = await self._stdout.receive()
                except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                    raise self._die("the engine process closed its pipe (it exited or was killed)") from None
            if not chunk:
                raise self._die(f"no frame from the engine for {self._heartbeat_timeout:g} s")
            try:
                self._pending.extend(self._frames.feed(chunk))
            except FrameError as e:
                raise self._die(str(e)) from e
        msg = self._pending.popleft()
        if isinstance(msg, (StepOutputs, Heartbeat)):
            self.stats = msg.stats
            return msg
        raise self._die(f"unexpected frame from a running engine: {type(msg).__name__}")

    def _die(self, why: str) -> EngineDeadError:
        if self.dead is None:
            self.dead = EngineDeadError(f"engine core died: {why}")
        return self.dead

    async def _shutdown(self, grace: float) -> None:
        with anyio.CancelScope(shield=True):
            if self.dead is None and self._process.returncode is None:
                try:
                    with anyio.move_on_after(1):
                        async with self._send_lock:
                            await self._stdin.send(self._encoder.encode(Shutdown()))
                except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                    pass
            with anyio.move_on_after(grace):
                await self._process.wait()
            if self._process.returncode is None:
                self._process.kill()
                await self._process.wait()
            await self._process.aclose()


def engine_command(config: EngineConfig) -> list[str]:
    return [sys.executable, "-m", "engine", "--config", json.dumps(config.to_dict())]


@asynccontextmanager
async def open_engine(config: EngineConfig, *, ready_timeout: float = 600.0,
                      heartbeat_timeout: float = 10.0, shutdown_grace: float = 5.0
                      ) -> AsyncIterator[EngineClient]:
    """Start the engine core, wait until it serves, yield a client; always stop the process on exit."""
    process = await anyio.open_process(engine_command(config), stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=None)
    frames: FrameBuffer[FromEngine] = FrameBuffer(FromEngine)
    try:
        ready = await _wait_ready(process, frames, ready_timeout)
    except BaseException:
        with anyio.CancelScope(shield=True):
            process.kill()
            await process.wait()
            await process.aclose()
        raise
    client = EngineClient(process, ready, frames, heartbeat_timeout)
    try:
        yield client
    finally:
        await client._shutdown(shutdown_grace)


async def _wait_ready(process: Process, frames: FrameBuffer[FromEngine], timeout: float) -> Ready:
    assert process.stdout is not None
    with anyio.fail_after(timeout):
        while True:
            try:
                chunk = await process.stdout.receive()
            except anyio.EndOfStream:
                code = await process.wait()
                raise EngineLoadError(
                    f"the engine exited with code {code} before it was ready; its log above says why"
                ) from None
            for msg in frames.feed(chunk):
                if isinstance(msg, LoadFailed):
                    raise EngineLoadError(msg.message)
                if isinstance(msg, Ready):
                    return msg
                # heartbeats while loading only prove liveness
