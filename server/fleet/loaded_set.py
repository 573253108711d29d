"""Which models of `--models-dir` have an engine running: load on first use, unload the least recently used idle one
when `--max-loaded-models` are loaded, unload after `--model-idle-timeout`, drain them all at shutdown.

Each model is a slot. A load is one task in the registry's task group that lives as long as the model stays loaded
(it enters the model app's lifespan, waits to be told to unload, and leaves it): concurrent first requests find the
slot loading and wait on its `done` event, so they cause one load. A slot is busy while requests are inside it or
wait for its load; only idle slots are unloaded, so no request in flight is ever cut; when every loaded slot is busy,
a load waits for one to go idle. A load that fails leaves the slot unloaded with its reason: the requests that
waited for it get a 503 naming it, and the next request tries again.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import anyio
import anyio.abc
from prometheus_client import CollectorRegistry, Counter, Gauge

from server.config import ServerConfig
from server.fleet.catalog import ModelEntry
from server.http import unavailable
from server.http.errors import describe_exception

log = logging.getLogger("spindle.server")

# quiet: several API processes only (server/fleet/follower.py): idle, admitting none until the owner decides
Status = Literal["unloaded", "queued", "loading", "loaded", "quiet", "unloading"]
_HOLDS_ENGINE = ("loading", "loaded", "unloading")  # counted against --max-loaded-models


@dataclass
class Loaded:
    """A model's running parts: its bare app (routes + lifespan), its AppState and its ServerMetrics."""

    app: Any
    state: Any
    metrics: Any


# (config, on_fatal(why) when its engine dies, its engine factory or None) -> its app, not yet started
MakeApp = Callable[[ServerConfig, Callable[[str], None], Any], Loaded]


class ModelSlot:
    def __init__(self, entry: ModelEntry) -> None:
        self.entry = entry
        self.status: Status = "unloaded"
        self.loaded: Loaded | None = None
        self.error: str | None = None  # why the last load failed (or the engine died)
        self.done = anyio.Event()  # the current load ended, loaded or failed
        self.release = anyio.Event()  # set: leave the lifespan (unload)
        self.gone = anyio.Event()  # the unload ended
        self.active = 0  # requests inside the model's app
        self.unload_when_idle = False  # a request asked for it (Ollama's keep_alive 0): unloaded once idle
        self.keep_alive: float | None = None  # Ollama's keep_alive: seconds idle before the unload (None: the flag's)
        self.waiting = 0  # requests waiting for its load
        self.last_used = 0.0

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def busy(self) -> bool:
        llm = self.loaded.state.llm if self.loaded is not None else None
        return bool(self.active or self.waiting or (llm is not None and llm.num_active))


class RegistryMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.loads = Counter(
            "spindle_model_loads",
            "Models loaded (first request, or after an unload).",
            ["model_name"],
            registry=registry,
        )
        self.load_failures = Counter(
            "spindle_model_load_failures", "Model loads that failed.", ["model_name"], registry=registry
        )
        self.unloads = Counter(
            "spindle_model_unloads",
            "Models unloaded (least recently used, idle timeout, engine death).",
            ["model_name"],
            registry=registry,
        )
        self.loaded = Gauge("spindle_models_loaded", "Models with an engine running now.", registry=registry)


class ModelRegistry:
    def __init__(
        self, config: ServerConfig, entries: dict[str, ModelEntry], make_app: MakeApp, metrics: RegistryMetrics
    ) -> None:
        self.config = config
        self.slots = {name: ModelSlot(entry) for name, entry in entries.items()}
        self.make_app, self.metrics = make_app, metrics
        self.max_loaded = config.models.max_loaded_models
        self.idle_timeout = config.models.model_idle_timeout
        self.stopping = False
        self._changed = anyio.Event()  # replaced at each change; waiters take the current one before looking
        self._tg: anyio.abc.TaskGroup | None = None
        self.on_gone: Callable[[ModelSlot], None] = lambda slot: None  # at each unload, before its parts go

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Own every load task (and the idle timer) until cancelled: cancelling unloads every model."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            tg.start_soon(self._unload_idle)
            task_status.started()
            try:
                await anyio.sleep_forever()
            finally:  # a request woken by an unload at shutdown must not start a load
                self.stopping = True

    async def until(self, condition: Callable[[], bool]) -> None:
        """Wait until `condition()` holds, looked at after each change of a slot."""
        while not condition():
            await self._changed.wait()

    def _notify(self) -> None:
        changed, self._changed = self._changed, anyio.Event()
        changed.set()

    async def acquire(self, slot: ModelSlot) -> Any:
        """The model's app, once loaded (loading it if need be): the caller is inside it until `release`.
        503 when its load fails (with the reason) or the server stops."""
        while slot.status != "loaded":
            if self.stopping:
                raise unavailable.shutting_down()
            if slot.status == "unloaded":
                self._start_load(slot)
            load = slot.done
            event = load if slot.status in ("queued", "loading") else slot.gone
            self._admit_waiting(slot)
            slot.waiting += 1
            try:
                await event.wait()
            finally:
                slot.waiting -= 1
                self._notify()
            if event is load and slot.status == "unloaded" and slot.error is not None:
                raise unavailable.unavailable(
                    f"The model `{slot.name}` could not be loaded ({slot.error}); its next request tries again."
                )
        slot.active += 1
        assert slot.loaded is not None
        return slot.loaded.app

    def _admit_waiting(self, slot: ModelSlot) -> None:
        """Requests waiting for a model's load count against its --max-num-queued-reqs (its own admission
        starts with its engine): beyond it, a 503 as from a full queue."""
        limit = slot.entry.settings.get("max_num_queued_reqs", self.config.scheduling.max_num_queued_reqs)
        if limit is not None and slot.waiting >= limit:
            raise unavailable.overloaded(f"{slot.waiting} requests already wait for `{slot.name}` to load")

    def release(self, slot: ModelSlot, count: int = 1) -> None:
        """A request left the model's app (`count` 0: work of one that outlived it ended)."""
        slot.active -= count
        slot.last_used = anyio.current_time()
        if slot.unload_when_idle and slot.status == "loaded" and not slot.busy:
            slot.unload_when_idle = False
            self._unload(slot, "a request's keep_alive 0")
        self._notify()

    def unload_soon(self, slot: ModelSlot) -> None:
        """Unload the model once its requests are done (Ollama's keep_alive 0), at once when it is idle."""
        slot.unload_when_idle = True
        self.release(slot, 0)

    def keep(self, slot: ModelSlot, seconds: float | None) -> None:
        """Ollama's keep_alive: unload the model `seconds` after its last request (0: once idle; inf: never by
        idleness; None: after --model-idle-timeout, if set)."""
        if seconds == 0:
            self.unload_soon(slot)
            return
        slot.keep_alive = seconds
        self._notify()

    def idle_limit(self, slot: ModelSlot) -> float | None:
        """Seconds idle before the model unloads (None: never by idleness)."""
        limit = slot.keep_alive if slot.keep_alive is not None else self.idle_timeout
        return None if limit is None or limit == float("inf") else limit

    def _start_load(self, slot: ModelSlot) -> None:
        assert self._tg is not None, "the registry is not running"
        slot.status, slot.error = "queued", None
        slot.done, slot.release, slot.gone = anyio.Event(), anyio.Event(), anyio.Event()
        self._tg.start_soon(self._load, slot, name=f"load {slot.name}")
        self._notify()

    async def _make_room(self, slot: ModelSlot) -> None:
        """Wait until fewer than --max-loaded-models others hold an engine, unloading the least recently used idle
        one meanwhile; then the slot is loading (no await between the count and the change: two loads cannot
        both take the last place)."""
        while True:
            held = [s for s in self.slots.values() if s is not slot and s.status in _HOLDS_ENGINE]
            if len(held) < self.max_loaded:
                slot.status = "loading"
                self._notify()
                return
            changed = self._changed
            idle = [s for s in held if s.status == "loaded" and not s.busy]
            if idle:
                self._unload(min(idle, key=lambda s: s.last_used), "least recently used")
            await changed.wait()

    async def _load(self, slot: ModelSlot) -> None:
        """The slot's life while it holds an engine: make room, load, serve until told to unload, unload. Nothing
        escapes but cancellation: one model's failure is that model's."""
        entered = False
        try:
            # its settings checked (a .gguf file read) before another model is unloaded to make room for it
            config = await anyio.to_thread.run_sync(slot.entry.config, self.config)
            loaded = self.make_app(config, lambda why: self._died(slot, why), None)
            await self._make_room(slot)
            log.info("loading model %s", slot.name)
            async with loaded.app.lifespan_context(loaded.app):
                entered = True
                await self._serve(slot, loaded)
        except Exception as e:  # noqa: BLE001 - one model's failure is that model's, reported and logged
            if entered:  # the unload (or the serving) failed: the model is gone all the same
                log.error("model %s stopped with an error: %s", slot.name, describe_exception(e))
            else:
                self._failed(slot, describe_exception(e))
        finally:
            if entered:
                self._gone(slot)

    def _failed(self, slot: ModelSlot, why: str) -> None:
        slot.status, slot.error = "unloaded", why
        log.error("model %s failed to load: %s", slot.name, why)
        self.metrics.load_failures.labels(slot.name).inc()
        slot.done.set()
        self._notify()

    def _gone(self, slot: ModelSlot) -> None:
        self.on_gone(slot)
        slot.status, slot.loaded = "unloaded", None
        gc.unfreeze()  # each load freezes what it built (server/app.py): the unloaded model's cycles collectable
        self.metrics.unloads.labels(slot.name).inc()
        self.metrics.loaded.dec()
        log.info("unloaded model %s", slot.name)
        slot.gone.set()
        self._notify()

    async def _serve(self, slot: ModelSlot, loaded: Loaded) -> None:
        if loaded.state.llm is not None:  # its last request's work ending (maybe after the request): it may unload
            loaded.state.llm.on_idle(lambda: self.release(slot, 0))
        slot.loaded, slot.status, slot.last_used = loaded, "loaded", anyio.current_time()
        self.metrics.loads.labels(slot.name).inc()
        self.metrics.loaded.inc()
        log.info("loaded model %s", slot.name)
        slot.done.set()
        self._notify()
        await slot.release.wait()

    def _unload(self, slot: ModelSlot, why: str) -> None:
        log.info("unloading model %s (%s)", slot.name, why)
        slot.status = "unloading"
        slot.release.set()

    def _died(self, slot: ModelSlot, why: str) -> None:
        """Its engine died: its requests already got the error; unload it, and its next request loads it again."""
        slot.error = why
        if slot.status == "loaded":
            self._unload(slot, why)

    async def _unload_idle(self) -> None:
        """--model-idle-timeout (or the model's keep_alive): unload each loaded model that many seconds after its
        last request ended."""
        while True:
            now, next_due = anyio.current_time(), float("inf")
            for slot in self.slots.values():
                timeout = self.idle_limit(slot)
                if slot.status != "loaded" or slot.busy or timeout is None:
                    continue
                due = slot.last_used + timeout
                if due <= now:
                    self._unload(slot, f"idle for {timeout:g} s")
                else:
                    next_due = min(next_due, due)
            changed = self._changed
            with anyio.move_on_after(next_due - now):
                await changed.wait()

    @property
    def num_active(self) -> int:
        return sum(
            s.waiting + (s.loaded.state.llm.num_active if s.loaded and s.loaded.state.llm else 0)
            for s in self.slots.values()
        )

    async def drain(self, timeout: float) -> int:
        """SIGTERM: refuse new requests, give every loaded model's requests up to `timeout` s, cut the rest."""
        self.stopping = True
        cut = 0

        async def one(llm: Any) -> None:
            nonlocal cut
            cut += await llm.drain(timeout)

        async with anyio.create_task_group() as tg:
            for llm in self._llms():
                tg.start_soon(one, llm)
        return cut

    def cut(self, message: str) -> int:
        self.stopping = True
        return sum(llm.cut(message) for llm in self._llms())

    def _llms(self) -> list[Any]:
        return [s.loaded.state.llm for s in self.slots.values() if s.loaded is not None and s.loaded.state.llm]
