"""--models-dir with --api-server-count N: the one owner of the loaded set, a task in API process 0.

Every API process (process 0 included, over a socket like the others) keeps its own registry of its side of each
model (server/fleet/follower.py) and talks to this owner over its control socket (server/fleet/control.py). The
owner alone decides loads and unloads, and holds --max-loaded-models, the LRU order and --model-idle-timeout:

- **Load.** A request for a model with no engine makes its process send Want; the owner loads once however many
  Wants come (from any process): it makes room (below), starts the engine with one channel per API process plus
  one of its own (`python -m engine --channels`, the engine of --api-server-count), waits for Ready on its own
  channel, then hands each API process its channel end (Loaded, the fd passed with SCM_RIGHTS); each process opens
  the model's app on it. A failed load is Failed to every process (its waiting requests get a 503 with the reason);
  the next Want tries again.
- **Unload, a handshake.** Each process reports when a model becomes busy or idle there (Activity: requests in it,
  waiting for it, or its app opening). To unload, the owner sends Quiesce to every process; a process where the
  model is idle stops admitting requests to it (they wait) and answers quiet; one where it is busy answers busy and
  changes nothing. All quiet: Unload, every process closes its channel (Closed), then the owner closes its own and
  the engine's stdin, and the engine exits. Any busy: Resume to the quiet ones, and the owner waits for the busy one's
  next idle Activity. So a model is unloaded only when no process has a request in flight or waiting for it.
- **Engine death** (the owner's channel ends): Unload to every process (their channels died too), then a reload on
  the next Want. A process whose own open of a model failed sends Lost: the model is unloaded when idle everywhere
  and loaded again for the next request.
- **Shutdown.** Each process drains its own requests (SIGTERM); the owner stops an engine only once every process
  has closed its control socket (it exited) or --shutdown-timeout + 10 s passed.
"""

from __future__ import annotations

import logging
import socket
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
import anyio.abc
from anyio.abc import Process

from engine.client.process_client import EngineDeadError, OwnedEngine, connect, engine_command
from server.config import ServerConfig
from server.fleet.catalog import ModelEntry
from server.fleet.control import (
    Activity,
    Closed,
    Control,
    Failed,
    KeepFor,
    Listing,
    ListModels,
    Loaded,
    Lost,
    Quiesce,
    Reply,
    Resume,
    ToOwner,
    Unload,
    Want,
)
from server.http.errors import describe_exception

log = logging.getLogger("spindle.server")

Status = Literal["unloaded", "queued", "loading", "loaded", "quiescing", "unloading"]
_HOLDS_ENGINE = ("loading", "loaded", "quiescing", "unloading")  # counted against --max-loaded-models


@dataclass
class OwnedModel:
    entry: ModelEntry
    status: Status = "unloaded"
    wanted: bool = False  # a Want came while it could not load at once: load again after its unload
    lost: set[int] = field(default_factory=set)  # processes whose side of it ended unasked: unload when idle
    busy: set[int] = field(default_factory=set)  # processes where it is busy
    last_used: float = 0.0
    keep_alive: float | None = None  # the last request's keep_alive: seconds idle before the unload (None: the flag's)
    replies: dict[int, bool] = field(default_factory=dict)  # this Quiesce's answers: process -> quiet
    closed: set[int] = field(default_factory=set)  # processes that closed their channel after Unload
    release: anyio.Event = field(default_factory=anyio.Event)

    @property
    def name(self) -> str:
        return self.entry.name


class _Engine(OwnedEngine):
    """The engine the owner started: its stdin is only its lifeline (it exits at EOF there once every channel is
    closed); a kill after `grace`."""

    async def stop(self, grace: float) -> None:
        if self.process.stdin is not None:
            await self.process.stdin.aclose()
        await super().stop(grace)


class ModelOwner:
    def __init__(self, config: ServerConfig, entries: dict[str, ModelEntry], fds: list[int]) -> None:
        self.config = config
        self.models = {name: OwnedModel(entry) for name, entry in entries.items()}
        self.controls = [Control(fd, ToOwner) for fd in fds]  # index: the API process
        self.live = set(range(len(fds)))  # processes whose control socket is open
        self.max_loaded = config.models.max_loaded_models
        self.stopping = False
        self._changed = anyio.Event()
        self._tg: anyio.abc.TaskGroup | None = None

    def _notify(self) -> None:
        changed, self._changed = self._changed, anyio.Event()
        changed.set()

    async def until(self, condition: Callable[[], bool]) -> None:
        while not condition():
            await self._changed.wait()

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with anyio.create_task_group() as tg:
            self._tg = tg
            for i, control in enumerate(self.controls):
                tg.start_soon(control.run_writer)
                tg.start_soon(self._listen, i)
            tg.start_soon(self._housekeeping)
            task_status.started()
            try:
                await anyio.sleep_forever()
            finally:
                self.stopping = True

    async def shutdown(self) -> None:
        """Before `run` is cancelled, with this process's own registry already closed: wait until every API process
        exited (each drains its own requests), up to --shutdown-timeout + 10 s; cancelling `run` then stops the
        engines."""
        self.stopping = True
        self._notify()
        with anyio.move_on_after(self.config.http.shutdown_timeout + 10):
            await self.until(lambda: not self.live)

    async def _listen(self, i: int) -> None:
        control = self.controls[i]
        try:
            while (got := await control.receive()) is not None:
                self._handle(i, got[0])
        finally:
            self.live.discard(i)
            for m in self.models.values():
                m.busy.discard(i)
            self._notify()

    def _handle(self, i: int, msg: Any) -> None:
        m = self.models.get(getattr(msg, "model", ""))
        if isinstance(msg, ListModels):
            loaded = [name for name, m in self.models.items() if m.status in ("loaded", "quiescing")]
            self.controls[i].post(Listing(msg.ticket, loaded))
            return
        if m is None:
            return
        if isinstance(msg, Want):
            if m.status == "loaded" and i in m.lost:  # that process has no channel: reload after the unload
                m.wanted = True
            elif m.status == "unloaded" and not self.stopping:
                self._start_load(m)
            elif m.status != "loaded":  # queued, loading: it comes; quiescing, unloading: it may go, then reload
                m.wanted = True
        elif isinstance(msg, Activity):
            (m.busy.add if msg.busy else m.busy.discard)(i)
            m.last_used = anyio.current_time()
        elif isinstance(msg, Reply):
            m.replies[i] = msg.quiet
            if not msg.quiet:
                m.busy.add(i)
        elif isinstance(msg, Closed):
            m.closed.add(i)
        elif isinstance(msg, KeepFor):
            m.keep_alive = msg.seconds
        elif isinstance(msg, Lost):
            log.warning("API process %d lost model %s (%s): it reloads once idle", i, m.name, msg.why)
            if m.status in ("loaded", "quiescing"):  # else its engine is going anyway (it died, most likely)
                m.lost.add(i)
        self._notify()

    def _start_load(self, m: OwnedModel) -> None:
        assert self._tg is not None
        m.status, m.wanted, m.release = "queued", False, anyio.Event()
        m.lost = set()
        self._tg.start_soon(self._load, m, name=f"load {m.name}")
        self._notify()

    async def _make_room(self, m: OwnedModel) -> None:
        """As the single server's registry: until fewer than --max-loaded-models others hold an engine, unloading the
        least recently used idle one; no await between the count and the change."""
        while True:
            changed = self._changed
            held = [s for s in self.models.values() if s is not m and s.status in _HOLDS_ENGINE]
            if len(held) < self.max_loaded:
                m.status = "loading"
                self._notify()
                return
            idle = [s for s in held if s.status == "loaded" and not s.busy]
            if idle and not any(s.status in ("quiescing", "unloading") for s in held):
                self._quiesce(min(idle, key=lambda s: s.last_used), "least recently used")
            await changed.wait()

    async def _load(self, m: OwnedModel) -> None:
        """The model's life while it holds an engine (one load however many processes want it)."""
        try:
            config = await anyio.to_thread.run_sync(m.entry.config, self.config)
            await self._make_room(m)
            log.info("loading model %s for %d API processes", m.name, len(self.controls))
            pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(len(self.controls) + 1)]
            try:
                fds = [a.fileno() for a, _ in pairs]
                process = await anyio.open_process(
                    [*engine_command(config.engine_config()), "--channels", ",".join(map(str, fds))],
                    stdin=subprocess.PIPE,
                    stdout=None,
                    stderr=None,
                    pass_fds=fds,
                )
            finally:
                for a, _ in pairs:
                    a.close()
            await self._serve(m, config, process, pairs)
        except Exception as e:  # noqa: BLE001 - one model's failure is that model's, reported to every process
            why = describe_exception(e)
            if m.status not in ("queued", "loading"):  # it served: the unload failed, the engine is gone all the same
                log.error("model %s stopped with an error: %s", m.name, why)
            else:
                log.error("model %s failed to load: %s", m.name, why)
                for i in sorted(self.live):
                    self.controls[i].post(Failed(m.name, why))
        finally:
            m.status = "unloaded"
            self._notify()
            if m.wanted and not self.stopping:
                self._start_load(m)

    async def _serve(self, m: OwnedModel, config: ServerConfig, process: Process, pairs: list[Any]) -> None:
        """Ready on the owner's channel: hand out the others, serve until unloaded or dead, then the Unload round."""
        own = pairs[-1][1]
        own.setblocking(False)
        stream = await anyio.abc.SocketStream.from_socket(own)
        e = config.engine
        try:
            async with connect(
                stream,
                _Engine(process),
                ready_timeout=e.engine_ready_timeout,
                heartbeat_timeout=e.engine_heartbeat_timeout,
                step_timeout=e.engine_step_timeout,
                shutdown_grace=2.0,
            ) as client:
                m.closed, m.replies = set(), {}
                for i, (_, end) in enumerate(pairs[:-1]):
                    if i in self.live:  # its end travels (closed here once sent); a gone process's is just closed
                        self.controls[i].post(Loaded(m.name, process.pid), end.detach())
                m.status, m.wanted, m.last_used = "loaded", False, anyio.current_time()
                log.info("loaded model %s (engine pid %d)", m.name, process.pid)
                self._notify()
                try:
                    await self._watch(m, client)
                finally:
                    with anyio.CancelScope(shield=True):
                        await self._unload_round(m)
        finally:
            for _, end in pairs[:-1]:
                end.close()  # a gone process's end (the detached ones: a no-op)

    async def _watch(self, m: OwnedModel, client: Any) -> None:
        """Until the model is released (the handshake) or its engine dies (the owner's channel ends)."""
        async with anyio.create_task_group() as tg:

            async def read() -> None:
                try:
                    while True:
                        await client.receive()
                except EngineDeadError as e:
                    log.error("model %s: %s; unloading it", m.name, e)
                tg.cancel_scope.cancel()

            tg.start_soon(read)
            await m.release.wait()
            tg.cancel_scope.cancel()

    async def _unload_round(self, m: OwnedModel) -> None:
        """Every process closes its channel (Unload, then its Closed); at shutdown, until every process exited. Then
        leaving `connect` closes the owner's channel and the engine's stdin: the engine exits."""
        m.status = "unloading"
        self._notify()
        if self.stopping:  # `shutdown` waited for the processes to exit
            return
        for i in sorted(self.live):
            self.controls[i].post(Unload(m.name))
        await self.until(lambda: self.stopping or self.live <= m.closed)
        log.info("model %s: every API process closed its channel; its engine stops", m.name)

    def _quiesce(self, m: OwnedModel, why: str) -> None:
        """Start the unload handshake (module docstring)."""
        assert self._tg is not None
        m.status, m.replies = "quiescing", {}
        log.info("model %s: %s; asking every API process whether it is idle there", m.name, why)
        for i in sorted(self.live):
            self.controls[i].post(Quiesce(m.name))
        self._tg.start_soon(self._settle, m)
        self._notify()

    async def _settle(self, m: OwnedModel) -> None:
        await self.until(lambda: self.stopping or self.live <= set(m.replies))
        if m.status != "quiescing":
            return
        if all(m.replies.get(i, True) for i in self.live):
            m.status = "unloading"
            m.release.set()
        else:
            log.info("model %s is busy in API process(es) %s: kept", m.name, [i for i, q in m.replies.items() if not q])
            for i, quiet in m.replies.items():
                if quiet and i in self.live:
                    self.controls[i].post(Resume(m.name))
            m.status, m.wanted = "loaded", False
        self._notify()

    async def _housekeeping(self) -> None:
        """--model-idle-timeout (or the model's keep_alive), and models a process lost: unload each when idle
        everywhere."""
        while True:
            changed = self._changed
            now, next_due = anyio.current_time(), float("inf")
            for m in self.models.values():
                if m.status != "loaded" or m.busy:
                    continue
                timeout = m.keep_alive if m.keep_alive is not None else self.config.models.model_idle_timeout
                if m.lost:
                    self._quiesce(m, "an API process lost its channel")
                elif timeout is not None and timeout != float("inf"):
                    due = m.last_used + timeout
                    if due <= now:
                        self._quiesce(m, f"idle for {timeout:g} s")
                    else:
                        next_due = min(next_due, due)
            with anyio.move_on_after(next_due - now):
                await changed.wait()
