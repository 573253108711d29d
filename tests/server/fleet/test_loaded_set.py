"""server/fleet/loaded_set.py with stand-in model apps (no engine): one load for concurrent first requests, LRU
order, a busy model never unloaded, a failed load retried, the idle timeout. tests/e2e/test_models_dir.py runs the
same paths against real engines."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import pytest
import trio.testing
from prometheus_client import CollectorRegistry

from server.config import ServerConfig
from server.fleet.catalog import scan
from server.fleet.loaded_set import Loaded, ModelRegistry, RegistryMetrics
from server.http.errors import APIError

pytestmark = pytest.mark.anyio


class Models:
    """Stand-in apps: each load and unload logged; a model's load waits for its gate when it has one."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str]] = []
        self.gates: dict[str, anyio.Event] = {}
        self.llms: dict[str, Any] = {}  # a model's stand-in AsyncLLM (none: no engine side)

    def make_app(self, config: ServerConfig, on_fatal: Callable[[str], None], engine: Any = None) -> Loaded:
        name = config.model.model_name
        models = self

        class App:
            @asynccontextmanager
            async def lifespan_context(self, app: Any) -> AsyncIterator[None]:
                models.log.append(("load", name))
                if name == "broken":
                    raise RuntimeError("no weights in the folder")
                if name in models.gates:
                    await models.gates[name].wait()
                try:
                    yield
                finally:
                    models.log.append(("unload", name))

        return Loaded(App(), SimpleNamespace(llm=models.llms.get(name), limits=None), None)


def registry(tmp_path: Path, models: Models, **settings: Any) -> ModelRegistry:
    for name in ("a", "b", "c", "broken"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    config = ServerConfig.from_settings(models_dir=str(tmp_path), **settings)
    return ModelRegistry(config, scan(tmp_path), models.make_app, RegistryMetrics(CollectorRegistry()))


async def use(reg: ModelRegistry, name: str) -> None:
    slot = reg.slots[name]
    await reg.acquire(slot)
    reg.release(slot)


def loaded(reg: ModelRegistry) -> list[str]:
    return sorted(name for name, slot in reg.slots.items() if slot.status == "loaded")


async def test_concurrent_first_requests_load_once(tmp_path: Path) -> None:
    models = Models()
    reg = registry(tmp_path, models)
    models.gates["a"] = anyio.Event()
    async with anyio.create_task_group() as tg:
        await tg.start(reg.run)
        async with anyio.create_task_group() as requests:
            for _ in range(5):
                requests.start_soon(use, reg, "a")
            await reg.until(lambda: reg.slots["a"].waiting == 5 and reg.slots["a"].status == "loading")
            models.gates["a"].set()
        assert models.log == [("load", "a")]
        assert loaded(reg) == ["a"]
        tg.cancel_scope.cancel()
    assert models.log == [("load", "a"), ("unload", "a")]  # the registry's end unloads every model


async def test_the_least_recently_used_model_is_unloaded_first(tmp_path: Path) -> None:
    models = Models()
    reg = registry(tmp_path, models, max_loaded_models=2)
    async with anyio.create_task_group() as tg:
        await tg.start(reg.run)
        for name in ("a", "b", "a", "c"):  # b is the least recently used when c needs room
            await use(reg, name)
        assert loaded(reg) == ["a", "c"]
        assert models.log == [("load", "a"), ("load", "b"), ("unload", "b"), ("load", "c")]
        await use(reg, "b")  # now a is the least recently used
        assert loaded(reg) == ["b", "c"]
        tg.cancel_scope.cancel()


async def test_a_busy_model_is_not_unloaded_and_the_load_waits(tmp_path: Path) -> None:
    models = Models()
    reg = registry(tmp_path, models)
    async with anyio.create_task_group() as tg:
        await tg.start(reg.run)
        a = reg.slots["a"]
        await reg.acquire(a)  # a request in flight in a
        async with anyio.create_task_group() as requests:
            requests.start_soon(use, reg, "b")
            await reg.until(lambda: reg.slots["b"].status == "queued")
            await anyio.wait_all_tasks_blocked()  # b's load waits for room (its settings were read in a thread)
            assert a.status == "loaded" and reg.slots["b"].status == "queued"
            assert models.log == [("load", "a")]
            reg.release(a)  # a goes idle: b's load unloads it
        assert models.log == [("load", "a"), ("unload", "a"), ("load", "b")]
        assert loaded(reg) == ["b"]
        tg.cancel_scope.cancel()


async def test_a_failed_load_is_a_503_for_that_model_and_retried(tmp_path: Path) -> None:
    models = Models()
    reg = registry(tmp_path, models, max_loaded_models=2)
    async with anyio.create_task_group() as tg:
        await tg.start(reg.run)
        await use(reg, "a")
        for _ in range(2):
            with pytest.raises(APIError) as refused:
                await use(reg, "broken")
            assert refused.value.status == 503
            assert "`broken` could not be loaded (RuntimeError: no weights in the folder)" in refused.value.message
        assert models.log == [("load", "a"), ("load", "broken"), ("load", "broken")]
        await use(reg, "a")  # the others keep serving
        assert loaded(reg) == ["a"]
        tg.cancel_scope.cancel()


@pytest.mark.parametrize("anyio_backend", [("trio", {"clock": trio.testing.MockClock(autojump_threshold=0)})])
async def test_the_idle_timeout_unloads_a_model_and_its_next_request_loads_it(tmp_path: Path) -> None:
    models = Models()
    reg = registry(tmp_path, models, model_idle_timeout=30.0)
    async with anyio.create_task_group() as tg:
        await tg.start(reg.run)
        a = reg.slots["a"]
        await reg.acquire(a)
        await anyio.sleep(100)  # busy for longer than the timeout: kept
        assert a.status == "loaded"
        reg.release(a)
        released = anyio.current_time()
        gone = a.gone
        await gone.wait()
        assert anyio.current_time() - released >= 30.0
        await use(reg, "a")
        assert models.log == [("load", "a"), ("unload", "a"), ("load", "a")]
        tg.cancel_scope.cancel()


async def test_requests_waiting_for_a_load_count_against_the_queue_limit(tmp_path: Path) -> None:
    models = Models()
    reg = registry(tmp_path, models, max_num_queued_reqs=2)
    models.gates["a"] = anyio.Event()
    async with anyio.create_task_group() as tg:
        await tg.start(reg.run)
        async with anyio.create_task_group() as requests:
            for _ in range(2):
                requests.start_soon(use, reg, "a")
            await reg.until(lambda: reg.slots["a"].waiting == 2)
            with pytest.raises(APIError) as refused:
                await use(reg, "a")
            assert refused.value.status == 503 and "2 requests already wait for `a`" in refused.value.message
            models.gates["a"].set()
        await use(reg, "a")  # loaded: the model's own admission decides from here
        tg.cancel_scope.cancel()


class BackgroundLLM:
    """A model's AsyncLLM with work that outlives its HTTP request (a background response)."""

    def __init__(self) -> None:
        self.num_active = 0
        self.idle: Callable[[], None] | None = None

    def on_idle(self, callback: Callable[[], None]) -> None:
        self.idle = callback

    def finish(self) -> None:
        self.num_active = 0
        assert self.idle is not None
        self.idle()


async def test_a_load_waits_for_work_that_outlives_its_request(tmp_path: Path) -> None:
    """a's request ended but its background work goes on: b's load waits, and goes on as soon as that work ends (no
    other request needed to look again)."""
    models = Models()
    llm = models.llms["a"] = BackgroundLLM()
    reg = registry(tmp_path, models)
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            await tg.start(reg.run)
            a = reg.slots["a"]
            await reg.acquire(a)
            llm.num_active = 1
            reg.release(a)  # the request is over, its work is not
            async with anyio.create_task_group() as requests:
                requests.start_soon(use, reg, "b")
                await reg.until(lambda: reg.slots["b"].status == "queued")
                await anyio.wait_all_tasks_blocked()
                assert models.log == [("load", "a")] and a.busy
                llm.finish()
            assert models.log == [("load", "a"), ("unload", "a"), ("load", "b")]
            tg.cancel_scope.cancel()


async def test_unload_soon_waits_for_the_models_requests_then_unloads(tmp_path: Path) -> None:
    """Ollama's keep_alive 0: the model goes once its last request is done, and its next request loads it."""
    models = Models()
    reg = registry(tmp_path, models)
    async with anyio.create_task_group() as tg:
        await tg.start(reg.run)
        a = reg.slots["a"]
        await reg.acquire(a)
        await reg.acquire(a)  # two requests in flight
        reg.unload_soon(a)
        reg.release(a)
        assert a.status == "loaded"  # one still runs
        gone = a.gone
        reg.release(a)
        await gone.wait()
        await use(reg, "a")
        assert models.log == [("load", "a"), ("unload", "a"), ("load", "a")]
        assert a.unload_when_idle is False
        tg.cancel_scope.cancel()
