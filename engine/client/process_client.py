"""The API server's side of the engine: start the subprocess, send requests, receive step frames.

Works on any anyio backend (Trio, asyncio, uvloop): the client reads and writes one anyio byte stream (the
subprocess's stdin and stdout stapled together, or one socket of a shared engine: engine/client/channel_client.py),
without a thread. Engine death (EOF, exit, silence past the heartbeat timeout) is an `EngineDeadError` from
`receive`, never a hang. Who owns the engine process, and so what leaving does to it, is an `EngineLifetime`:
`OwnedEngine` (the subprocess started here: waited for, then killed) or a shared engine's (left running).
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Protocol

import anyio
import anyio.abc
from anyio.abc import ByteStream, Process
from anyio.streams.stapled import StapledByteStream

from engine.config import EngineConfig, EngineEnv
from engine.messages import (
    AbortRequests,
    AddRequest,
    EngineStats,
    FromEngine,
    Heartbeat,
    LoadFailed,
    Ready,
    StepOutputs,
)
from engine.transport.ipc import FrameBuffer, FrameEncoder, FrameError


class EngineDeadError(RuntimeError):
    """The engine process is gone or silent; every in-flight request must fail."""


class EngineLoadError(RuntimeError):
    """The engine could not start serving (the model failed to load); the message says why."""


class EngineLifetime(Protocol):
    """Who owns the engine process behind a client's stream: what an early EOF means, what leaving does."""

    @property
    def pid(self) -> int:
        """The engine core's process id."""
        ...

    async def exited(self) -> str:
        """The stream ended before Ready: what became of the engine (for the error message)."""
        ...

    async def stop(self, grace: float) -> None:
        """The client has sent EOF: end the engine if it is ours (after `grace` s at most), else leave it."""
        ...


class OwnedEngine:
    """The engine subprocess this client started (`open_engine`): it ends with the client."""

    def __init__(self, process: Process) -> None:
        self.process = process

    @property
    def pid(self) -> int:
        return self.process.pid

    async def exited(self) -> str:
        return f"the engine exited with code {await self.process.wait()}"

    async def stop(self, grace: float) -> None:
        """EOF ends the engine's loop: wait up to `grace` s for it to exit, then SIGKILL."""
        process = self.process
        if grace > 0 and process.returncode is None:
            with anyio.move_on_after(grace):
                await process.wait()
        if process.returncode is None:
            process.kill()  # SIGKILL ends even a SIGSTOPped engine
            await process.wait()
        await process.aclose()


class EngineClient:
    """The engine's stream. One task writes (`_write_loop`), one reads (`receive`).

    `add_request` and `abort` only queue: they never wait on the pipe, so cancelling a caller can never
    cut a frame, and the output handler (which aborts on stop strings) never waits for the engine.
    """

    def __init__(
        self,
        stream: ByteStream,
        lifetime: EngineLifetime,
        ready: Ready,
        frames: FrameBuffer[FromEngine],
        heartbeat_timeout: float,
        step_timeout: float = 0.0,
    ) -> None:
        """stream: frames to and from the engine; frames: what was read past Ready (`wait_ready`)."""
        self._stream = stream
        self._lifetime = lifetime
        self._frames = frames
        self._pending: deque[FromEngine] = deque()
        self._encoder = FrameEncoder()
        self._queue: deque[AddRequest | list[str]] = deque()  # adds, and lists of ids to abort
        self._queued_adds: set[str] = set()  # adds not yet written: an abort just drops them
        self._queue_ready: anyio.Event | None = None  # set when the writer waits on an empty queue
        self._writer_scope = anyio.CancelScope()
        self._heartbeat_timeout = heartbeat_timeout
        self._step_timeout = step_timeout
        self.ready = ready
        self.stats = EngineStats(0, 0, 0, ready.num_blocks, 0, 0, 0)
        self.dead: EngineDeadError | None = None

    @property
    def pid(self) -> int:
        return self._lifetime.pid

    @property
    def queued(self) -> int:
        """Messages waiting for the writer (adds still cancellable, abort batches)."""
        return len(self._queue)

    def add_request(self, req: AddRequest) -> None:
        """Queue `req` for the engine; raises EngineDeadError once the engine is gone."""
        if self.dead is not None:
            raise self.dead
        self._queued_adds.add(req.request_id)
        self._push(req)

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests: one whose add is still queued is dropped; the others follow their add in order."""
        if not request_ids or self.dead is not None:
            return
        queued = self._queued_adds
        sent = [rid for rid in request_ids if rid not in queued]
        queued.difference_update(request_ids)
        if not sent:
            return
        last = self._queue[-1] if self._queue else None
        if isinstance(last, list):  # aborts queued back to back go out as one frame
            last.extend(sent)
        else:
            self._push(sent)

    def _push(self, item: AddRequest | list[str]) -> None:
        self._queue.append(item)
        if self._queue_ready is not None:
            self._queue_ready.set()
            self._queue_ready = None

    def _take(self) -> bytes:
        """Encode everything queued into one write (the frames stay whole: only this task writes)."""
        parts: list[bytes] = []
        queue, queued, encode = self._queue, self._queued_adds, self._encoder.encode
        while queue:
            item = queue.popleft()
            if isinstance(item, list):
                parts.append(encode(AbortRequests(item)))
            elif item.request_id in queued:
                queued.discard(item.request_id)
                parts.append(encode(item))
        return b"".join(parts)

    async def _write_loop(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """The one writer of the engine's stream. Ends when cancelled or when the engine is gone."""
        with self._writer_scope:
            task_status.started()
            while self.dead is None:
                if not self._queue:
                    self._queue_ready = anyio.Event()
                    await self._queue_ready.wait()
                    continue
                data = self._take()
                if not data:
                    continue
                try:
                    await self._stream.send(data)
                except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as e:
                    self._die(f"the engine process stopped reading its pipe ({e!r})")

    async def receive(self) -> StepOutputs | Heartbeat:
        """The next frame; call it from one task only."""
        while not self._pending:
            if self.dead is not None:
                raise self.dead
            chunk = b""
            with anyio.move_on_after(self._heartbeat_timeout):
                try:
                    chunk = await self._stream.receive()
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
            if (
                isinstance(msg, Heartbeat)
                and self._step_timeout
                and msg.step_started
                and msg.timestamp - msg.step_started > self._step_timeout
            ):
                raise self._die(
                    f"one engine step has run for over {self._step_timeout:g} s "
                    "(SPINDLE_ENGINE_STEP_TIMEOUT): the engine is hung"
                )
            return msg
        raise self._die(f"unexpected frame from a running engine: {type(msg).__name__}")

    def _die(self, why: str) -> EngineDeadError:
        if self.dead is None:
            self.dead = EngineDeadError(f"engine core died: {why}")
            self._writer_scope.cancel()  # a writer blocked on a stopped engine's full pipe must not linger
        return self.dead

    async def _shutdown(self, grace: float) -> None:
        """Send EOF (it ends the engine's loop, or its loop's hold on this channel), let the lifetime end the
        engine if it is ours, close the stream. Bounded throughout."""
        self._writer_scope.cancel()
        with anyio.CancelScope(shield=True), anyio.move_on_after(grace + 2):
            try:
                with anyio.move_on_after(0.1):  # a writer cut mid-frame leaves nothing worth flushing
                    await self._stream.send_eof()
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                pass
            await self._lifetime.stop(grace)
            await self._stream.aclose()


ENGINE_COMMAND_ENV = "SPINDLE_ENGINE_COMMAND"


def engine_command(config: EngineConfig) -> list[str]:
    """The engine core's command line. For benchmarks and tests only, SPINDLE_ENGINE_COMMAND (a shell-quoted
    command, e.g. `python -m bench.fake_engine_process`) replaces `python -m engine` with another program
    that speaks the same frames; it gets the same arguments (`--config JSON`, and `--channels` from the
    `--api-server-count` launcher)."""
    program = shlex.split(EngineEnv.read().engine_command) or [sys.executable, "-m", "engine"]
    return [*program, "--config", json.dumps(config.to_dict())]


@asynccontextmanager
async def open_engine(
    config: EngineConfig,
    *,
    ready_timeout: float = 600.0,
    heartbeat_timeout: float = 10.0,
    step_timeout: float = 0.0,
    shutdown_grace: float = 0.5,
) -> AsyncIterator[EngineClient]:
    """Start the engine core, wait until it serves, yield a client whose stdin writer runs inside this
    context; always stop the process on exit (within `shutdown_grace` + a kill)."""
    process = await anyio.open_process(
        engine_command(config), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None
    )
    assert process.stdin is not None and process.stdout is not None
    stream = StapledByteStream(process.stdin, process.stdout)
    async with connect(
        stream,
        OwnedEngine(process),
        ready_timeout=ready_timeout,
        heartbeat_timeout=heartbeat_timeout,
        step_timeout=step_timeout,
        shutdown_grace=shutdown_grace,
    ) as client:
        yield client


@asynccontextmanager
async def connect(
    stream: ByteStream,
    lifetime: EngineLifetime,
    *,
    ready_timeout: float,
    heartbeat_timeout: float,
    step_timeout: float,
    shutdown_grace: float,
) -> AsyncIterator[EngineClient]:
    """Wait for Ready on `stream`, yield a client over it with its writer running; on exit (or a failed start)
    close the stream and end the engine as `lifetime` says."""
    frames: FrameBuffer[FromEngine] = FrameBuffer(FromEngine)
    try:
        ready = await wait_ready(stream, lifetime, frames, ready_timeout)
    except BaseException:
        with anyio.CancelScope(shield=True), anyio.move_on_after(5):
            await lifetime.stop(0)  # ours: killed now
            await stream.aclose()
        raise
    async with running(
        EngineClient(stream, lifetime, ready, frames, heartbeat_timeout, step_timeout), shutdown_grace
    ) as client:
        yield client


@asynccontextmanager
async def running(client: EngineClient, shutdown_grace: float) -> AsyncIterator[EngineClient]:
    """The client with its writer task running inside this context; the client shut down on exit."""
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(client._write_loop)
            try:
                yield client
            finally:
                tg.cancel_scope.cancel()
    finally:
        await client._shutdown(shutdown_grace)


async def wait_ready(
    stream: ByteStream, lifetime: EngineLifetime, frames: FrameBuffer[FromEngine], timeout: float
) -> Ready:
    """Read frames until Ready; EngineLoadError on LoadFailed or an EOF first."""
    with anyio.fail_after(timeout):
        while True:
            try:
                chunk = await stream.receive()
            except anyio.EndOfStream:
                raise EngineLoadError(
                    f"{await lifetime.exited()} before it was ready; its log above says why"
                ) from None
            for msg in frames.feed(chunk):
                if isinstance(msg, LoadFailed):
                    raise EngineLoadError(msg.message)
                if isinstance(msg, Ready):
                    return msg
                # heartbeats while loading only prove liveness
