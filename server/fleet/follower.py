"""--models-dir with --api-server-count N: one API process's registry, which loads and unloads only as the owner says
(server/fleet/owner.py; the messages: server/fleet/control.py).

A request for a model not loaded here sends Want and waits (its streamed answer gets keep-alives, as in one
process); the owner's Loaded brings this process's channel to the model's new engine, and the model's app is opened
on it (its own renderer, AsyncLLM, admission, metrics: the single-model app, as one process does); Failed ends the
waiting requests with a 503. Each change of a model between busy (requests in it or waiting for it, or its app
opening) and idle is reported (Activity). Quiesce is answered at once from the state here: quiet (and no new request
is admitted until Resume or Unload) or busy; Unload closes the app and its channel, then Closed. When the app ends
unasked (its open failed here, or its channel died), Lost.
"""

from __future__ import annotations

import itertools
import logging
import socket
from contextlib import AbstractAsyncContextManager
from typing import Any

import anyio
import anyio.abc

from engine.client.channel_client import open_engine_channel
from server.config import ServerConfig
from server.fleet.catalog import ModelEntry
from server.fleet.control import (
    Activity,
    Closed,
    Control,
    Failed,
    FromOwner,
    KeepFor,
    Listing,
    ListModels,
    Loaded,
    Lost,
    Quiesce,
    Reply,
    Resume,
    Unload,
    Want,
)
from server.fleet.loaded_set import MakeApp, ModelRegistry, ModelSlot, RegistryMetrics
from server.http import unavailable
from server.http.errors import describe_exception

log = logging.getLogger("spindle.server")


class FollowerRegistry(ModelRegistry):
    def __init__(
        self,
        config: ServerConfig,
        entries: dict[str, ModelEntry],
        make_app: MakeApp,
        metrics: RegistryMetrics,
        control_fd: int,
    ) -> None:
        super().__init__(config, entries, make_app, metrics)
        self.control = Control(control_fd, FromOwner)
        self.owner_gone = False
        self._reported = dict.fromkeys(self.slots, False)  # what the owner was last told: busy or idle
        self._failures = dict.fromkeys(self.slots, 0)  # Failed (or an open failing here) per model
        self._closing: set[str] = set()  # Unload received: Closed when the app is gone
        self._tickets = itertools.count()
        self._listings: dict[int, list[str] | None] = {}

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                tg.start_soon(self.control.run_writer)
                tg.start_soon(self._listen)
                task_status.started()
                try:
                    await anyio.sleep_forever()
                finally:  # a request woken by the shutdown must not wait for a load
                    self.stopping = True
                    self._notify()
        finally:
            self.control.close()  # the owner sees this process gone (its apps are closed by now)

    def _notify(self) -> None:
        super()._notify()
        for name, slot in self.slots.items():
            busy = _engaged(slot)
            if busy != self._reported[name]:
                self._reported[name] = busy
                self.control.post(Activity(name, busy))

    async def acquire(self, slot: ModelSlot) -> Any:
        """The model's app once loaded here (Want sent, the owner loads it once for every process); 503 when its load
        fails or the server stops."""
        failures = self._failures[slot.name]
        while slot.status != "loaded":
            if self.stopping or self.owner_gone:
                raise unavailable.shutting_down()
            if self._failures[slot.name] != failures:
                raise unavailable.unavailable(
                    f"The model `{slot.name}` could not be loaded ({slot.error}); its next request tries again."
                )
            self._admit_waiting(slot)
            self.control.post(Want(slot.name))
            slot.waiting += 1
            self._notify()
            try:
                await self.until(
                    lambda: (
                        slot.status == "loaded"
                        or self.stopping
                        or self.owner_gone
                        or self._failures[slot.name] != failures
                    )
                )
            except BaseException:
                slot.waiting -= 1
                self._notify()
                raise
            slot.waiting -= 1
            if not _is_open(slot):  # (open: it enters at once, and is reported busy without a blip of idle)
                self._notify()
        slot.active += 1
        self._notify()
        assert slot.loaded is not None
        return slot.loaded.app

    async def _listen(self) -> None:
        while (got := await self.control.receive()) is not None:
            msg, fd = got
            if isinstance(msg, Listing):
                if msg.ticket in self._listings:  # (its asker may have left)
                    self._listings[msg.ticket] = msg.loaded
                self._notify()
                continue
            slot = self.slots.get(msg.model)
            if slot is None:
                continue
            if isinstance(msg, Loaded):
                assert fd is not None
                self._open(slot, socket.socket(fileno=fd), msg.pid)
            elif isinstance(msg, Failed):
                slot.error = msg.why
                self._failures[slot.name] += 1
                self.metrics.load_failures.labels(slot.name).inc()
            elif isinstance(msg, Quiesce):
                quiet = not _engaged(slot) and slot.status in ("loaded", "unloaded")
                if quiet and slot.status == "loaded":
                    slot.status = "quiet"  # admits no request until Resume or Unload
                self._reported[slot.name] = not quiet  # a busy answer counts as busy there: idle is told later
                self.control.post(Reply(slot.name, quiet))
            elif isinstance(msg, Resume) and slot.status == "quiet":
                slot.status = "loaded"
            elif isinstance(msg, Unload):
                self._unload_now(slot)
            self._notify()
        self.owner_gone = True  # API process 0 exited: this one is stopping too
        self._notify()

    def keep(self, slot: ModelSlot, seconds: float | None) -> None:
        """keep_alive: the owner holds the idle unloads (0 unloads once idle here too, as in one process)."""
        super().keep(slot, seconds)
        if seconds != 0:
            self.control.post(KeepFor(slot.name, seconds))

    def _unload_now(self, slot: ModelSlot) -> None:
        if slot.status == "unloaded":
            self.control.post(Closed(slot.name))
            return
        self._closing.add(slot.name)
        if slot.status != "unloading":
            self._unload(slot, "the owner unloads it")

    def _open(self, slot: ModelSlot, channel: socket.socket, pid: int) -> None:
        assert self._tg is not None
        slot.status, slot.error = "loading", None
        slot.done, slot.release, slot.gone = anyio.Event(), anyio.Event(), anyio.Event()
        self._tg.start_soon(self._load_here, slot, channel, pid, name=f"open {slot.name}")

    async def _load_here(self, slot: ModelSlot, channel: socket.socket, pid: int) -> None:
        """This process's side of the model while its engine runs: its app over `channel`."""
        entered = False
        try:
            config = await anyio.to_thread.run_sync(slot.entry.config, self.config)

            def engine(cfg: ServerConfig) -> AbstractAsyncContextManager[Any]:
                e = cfg.engine
                return open_engine_channel(
                    channel.detach(),
                    pid,
                    ready_timeout=e.engine_ready_timeout,
                    heartbeat_timeout=e.engine_heartbeat_timeout,
                    step_timeout=e.engine_step_timeout,
                )

            loaded = self.make_app(config, lambda why: self._died(slot, why), engine)
            async with loaded.app.lifespan_context(loaded.app):
                entered = True
                await self._serve(slot, loaded)
        except Exception as e:  # noqa: BLE001 - this model's failure here is this model's
            if entered:
                log.error("model %s stopped with an error: %s", slot.name, describe_exception(e))
            else:
                slot.status, slot.error = "unloaded", describe_exception(e)
                log.error("model %s failed to open: %s", slot.name, slot.error)
                self._failures[slot.name] += 1
        finally:
            channel.close()  # not opened (a detached one: a no-op)
            if entered:
                self._gone(slot)
            slot.gone.set()
            if slot.name in self._closing:
                self._closing.discard(slot.name)
                self.control.post(Closed(slot.name))
            elif not self.stopping:  # ended unasked: its open failed here, or its channel died
                self.control.post(Lost(slot.name, slot.error or "its channel closed"))
            self._notify()

    async def loaded_names(self) -> set[str]:
        """The models the owner has loaded (the same answer in every process); this process's own view if the owner
        is gone."""
        ticket = next(self._tickets)
        self._listings[ticket] = None
        self.control.post(ListModels(ticket))
        try:
            await self.until(lambda: self._listings[ticket] is not None or self.owner_gone)
            found = self._listings[ticket]
        finally:
            del self._listings[ticket]
        if found is None:
            return {name for name, slot in self.slots.items() if slot.status == "loaded"}
        return set(found)

    async def drain(self, timeout: float) -> int:
        """SIGTERM: as one process's registry, and the requests waiting for a load get their 503 at once."""
        self.stopping = True
        self._notify()
        return await super().drain(timeout)

    def cut(self, message: str) -> int:
        self.stopping = True
        self._notify()
        return super().cut(message)

    def _died(self, slot: ModelSlot, why: str) -> None:
        """Its channel died (the engine died, most likely): unload here; the owner sees the engine's end too."""
        super()._died(slot, why)
        if slot.status == "quiet":
            self._unload(slot, why)


def _is_open(slot: ModelSlot) -> bool:
    return slot.status == "loaded"


def _engaged(slot: ModelSlot) -> bool:
    """Holding the model's engine here: requests inside its app (or their work), or its app opening. Requests waiting
    while it is not open here hold nothing (in one process they count, as they wait for its load)."""
    llm = slot.loaded.state.llm if slot.loaded is not None else None
    entering = slot.status == "loaded" and slot.waiting  # woken by its open, not yet inside
    return bool(slot.active or (llm is not None and llm.num_active) or slot.status == "loading" or entering)
