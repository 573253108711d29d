"""A pool of render/tokenize worker processes (server/render/render_worker.py), driven from anyio without threads.

Each worker serves one request at a time over its stdin/stdout. A request that overruns its time limit
gets its worker SIGKILLed and reaped (its CPU stops), and a fresh worker takes the slot in the
background. A caller cancelled mid-request leaves the worker to a drain task that reads the late reply
before the worker is reused. Works on Trio and asyncio.
"""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys
from collections import deque
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import msgspec
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from engine.transport.ipc import FrameBuffer, FrameEncoder, FrameError
from server.render.child import OK, USER_ERROR

log = logging.getLogger(__name__)

_MAX_REPLY_BYTES = 512 << 20  # a reply this large means a broken (or subverted) worker
_STARTUP_TIMEOUT = 120.0  # seconds to import, load the tokenizer and report ready (slow disks, busy CPUs)
_REPO_ROOT = str(Path(__file__).resolve().parents[2])
# What a worker inherits of the server's environment: what Python, locales and temp files need, never
# credentials (HF_TOKEN, API keys...): a template that escapes the sandbox finds nothing to steal.
_ENV_NAMES = frozenset(
    {
        "PATH",
        "HOME",
        "USER",
        "LOGNAME",
        "LANG",
        "LANGUAGE",
        "TZ",
        "TMPDIR",
        "TEMP",
        "TMP",
        "LD_LIBRARY_PATH",
        "PYTHONPATH",
        "PYTHONHOME",
        "PYTHONNOUSERSITE",
        "PYTHONUSERBASE",
        "PYTHONSAFEPATH",
        "PYTHONPLATLIBDIR",
        "PYTHONUTF8",
        "PYTHONIOENCODING",
        "PYTHONDONTWRITEBYTECODE",
        "PYTHONPYCACHEPREFIX",
        "PYTHONUNBUFFERED",
        "PYTHONHASHSEED",
        "PYTHONWARNINGS",
        "PYTHONFAULTHANDLER",
        "PYTHONDEVMODE",
        "PYTHONMALLOC",
        "COVERAGE_PROCESS_START",
    }
)
_ENV_PREFIXES = ("LC_",)
_Reply = tuple[int, Any]
_encoder = FrameEncoder()


class WorkerUserError(Exception):
    """The worker refused the request (template error, memory limit); the message is safe for clients."""


class WorkerTimeout(Exception):
    """The request ran past its time limit; its worker was killed."""


class WorkerCrashed(Exception):
    """The worker died or broke protocol while serving the request; it is being replaced."""


class PoolOverloaded(Exception):
    """Too many requests are already waiting for a worker."""


def worker_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The allow-listed part of `environ` (_ENV_NAMES, LC_*): a worker starts without the server's secrets."""
    return {k: v for k, v in environ.items() if k in _ENV_NAMES or k.startswith(_ENV_PREFIXES)}


class _Worker:
    def __init__(self, proc: anyio.abc.Process) -> None:
        self.proc = proc
        assert proc.stdin is not None and proc.stdout is not None
        self._stdin = proc.stdin
        self._stdout = proc.stdout
        # Bytes and replies read but not yet returned; kept across a cancelled read so a drain resumes mid-frame.
        self._frames: FrameBuffer[_Reply] = FrameBuffer(_Reply, max_frame=_MAX_REPLY_BYTES)
        self._replies: deque[_Reply] = deque()

    async def send(self, frame: bytes) -> None:
        await self._stdin.send(frame)

    async def receive(self) -> _Reply:
        while not self._replies:
            # Large reads: a small reply arrives in one wake-up and one syscall.
            self._replies.extend(self._frames.feed(await self._stdout.receive(max(1 << 16, self._frames.missing))))
        return self._replies.popleft()

    def alive(self) -> bool:
        """False once the process exited, even before the event loop reaped it (a zombie).

        asyncio reports a write into a dead worker's pipe only later, as a lost connection, so a
        request sent to a zombie would look like a crash mid-render; look before sending.
        """
        if self.proc.returncode is not None:
            return False
        try:
            with open(f"/proc/{self.proc.pid}/stat", "rb") as f:
                return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
        except FileNotFoundError:
            return False
        except OSError:  # no /proc (not Linux): trust returncode
            return True

    async def kill(self) -> None:
        with anyio.CancelScope(shield=True), anyio.move_on_after(_REAP_LIMIT):  # shielded, never unbounded
            if self.proc.returncode is None:
                self.proc.kill()
            await self.proc.wait()  # reap: the pid is gone once this returns
            await self.proc.aclose()


_SEND_LIMIT = 10.0  # seconds an idle worker may take to read a request
_REAP_LIMIT = 5.0  # seconds to reap a SIGKILLed worker
_BROKEN = (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, anyio.ClosedResourceError, FrameError)


class WorkerPool:
    """`size` workers; `call()` waits for a free one (at most `max_waiting` callers wait, more are refused)."""

    def __init__(
        self,
        size: int,
        config: dict[str, Any],
        max_waiting: int,
        tg: anyio.abc.TaskGroup,
        module: str = "server.render.render_worker",
    ) -> None:
        self._config = config
        self._module = module  # the worker's `python -m` module: same frames, same reply codes
        self._name = (
            "renderer" if module == "server.render.render_worker" else module.rsplit(".", 1)[0].rsplit(".", 1)[-1]
        )
        self._max_waiting = max_waiting
        self._waiting = 0
        self._tg = tg
        self._idle_send: MemoryObjectSendStream[_Worker]
        self._idle_recv: MemoryObjectReceiveStream[_Worker]
        self._idle_send, self._idle_recv = anyio.create_memory_object_stream[_Worker](size)
        self._all: set[_Worker] = set()
        self._closing = False

    @classmethod
    @asynccontextmanager
    async def open(
        cls, size: int, config: dict[str, Any], *, max_waiting: int = 256, module: str = "server.render.render_worker"
    ) -> AsyncIterator[WorkerPool]:
        if size < 1:
            raise ValueError(f"the renderer needs at least 1 worker, got {size}")
        async with anyio.create_task_group() as tg:
            pool = cls(size, config, max_waiting, tg, module)
            try:
                failures: list[BaseException] = []
                async with anyio.create_task_group() as starting:
                    for _ in range(size):
                        starting.start_soon(pool._spawn_into_idle, failures)
                if failures:  # a worker that cannot start fails open(), with its own error
                    raise failures[0]
                yield pool
            finally:
                pool._closing = True
                tg.cancel_scope.cancel()
                with anyio.CancelScope(shield=True):
                    for worker in list(pool._all):
                        await worker.kill()
                pool._idle_send.close()
                pool._idle_recv.close()

    @property
    def pids(self) -> list[int]:
        return sorted(w.proc.pid for w in self._all)

    async def _spawn(self) -> _Worker:
        env = worker_env(os.environ)
        # One allocator arena and no tokenizer threads: keeps the address-space cap meaningful.
        env.update(MALLOC_ARENA_MAX="2", RAYON_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO_ROOT, env.get("PYTHONPATH")) if p)
        proc = await anyio.open_process(
            [sys.executable, "-m", self._module], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None, env=env
        )
        worker = _Worker(proc)
        self._all.add(worker)
        try:
            with anyio.fail_after(_STARTUP_TIMEOUT):
                await worker.send(_encoder.encode(self._config))
                code, value = await worker.receive()
            if code == USER_ERROR:
                raise WorkerUserError(value)
            if code != OK:
                raise WorkerCrashed(f"worker failed to start: {value}")
        except BaseException:
            self._all.discard(worker)
            await worker.kill()
            raise
        return worker

    async def _spawn_into_idle(self, failures: list[BaseException]) -> None:
        try:
            self._release(await self._spawn())
        except Exception as e:  # noqa: BLE001 - collected, re-raised by open()
            failures.append(e)

    async def _start_into_idle(self) -> None:
        delay = 0.1
        while True:
            try:
                worker = await self._spawn()
            except Exception as e:  # noqa: BLE001 - keep trying: the slot must come back
                log.error("%s worker failed to start (%s); retrying in %.1f s", self._name, e, delay)
                await anyio.sleep(delay)
                delay = min(delay * 2, 10.0)
                continue
            self._release(worker)
            return

    def _release(self, worker: _Worker) -> None:
        if self._closing:  # open() is tearing down: it kills everything in _all
            return
        self._idle_send.send_nowait(worker)

    async def _replace(self, worker: _Worker) -> None:
        self._all.discard(worker)
        await worker.kill()
        if not self._closing:
            self._tg.start_soon(self._start_into_idle)

    async def _drain(self, worker: _Worker, deadline: float) -> None:
        # The caller left; read its late reply so the worker can be reused, or kill it at the deadline.
        with anyio.move_on_after(max(0.0, deadline - anyio.current_time())):
            try:
                await worker.receive()
            except _BROKEN:
                await self._replace(worker)
                return
            self._release(worker)
            return
        await self._replace(worker)

    async def call(self, request: list[Any], timeout: float | None = None) -> Any:
        """Send one request to a free worker and return its result.

        Raises WorkerUserError, WorkerTimeout (worker killed), WorkerCrashed or PoolOverloaded.
        """
        try:
            frame = _encoder.encode(request)
        except (msgspec.EncodeError, UnicodeEncodeError, TypeError, OverflowError) as e:
            raise WorkerUserError(f"the request holds a value the renderer cannot take: {e}") from None
        while True:
            worker = await self._acquire()
            if not worker.alive():  # it died while idle: replace it and use another
                await self._replace(worker)
                continue
            sent = False
            try:
                # a half-written frame would desync the worker: shielded, but an idle worker that does not
                # read within the limit is wedged and gets replaced
                with anyio.CancelScope(shield=True), anyio.move_on_after(_SEND_LIMIT):
                    await worker.send(frame)
                    sent = True
            except _BROKEN:  # it died while idle: replace it and use another
                await self._replace(worker)
                continue
            if sent:
                break
            await self._replace(worker)
            raise WorkerTimeout(f"the {self._name} worker did not take the request within {_SEND_LIMIT:g} s")
        deadline = anyio.current_time() + (math.inf if timeout is None else timeout)
        reply: _Reply | None = None
        try:
            with anyio.move_on_after(max(0.0, deadline - anyio.current_time())):
                reply = await worker.receive()
        except _BROKEN as e:
            await self._replace(worker)
            raise WorkerCrashed(f"{self._name} worker died: {e!r}") from None
        except anyio.get_cancelled_exc_class():
            self._tg.start_soon(self._drain, worker, deadline)
            raise
        except BaseException:
            await self._replace(worker)
            raise
        if reply is None:
            await self._replace(worker)
            raise WorkerTimeout(f"did not finish within {timeout} s")
        self._release(worker)
        code, value = reply
        if code == USER_ERROR:
            raise WorkerUserError(value)
        if code != OK:
            raise WorkerCrashed(f"{self._name} worker error: {value}")
        return value

    async def _acquire(self) -> _Worker:
        if self._waiting >= self._max_waiting:
            raise PoolOverloaded(f"{self._waiting} requests are already waiting for the {self._name}")
        self._waiting += 1
        try:
            return await self._idle_recv.receive()
        finally:
            self._waiting -= 1
