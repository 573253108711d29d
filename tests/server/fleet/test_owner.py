"""server/fleet/owner.py against two stand-in API processes (their control sockets driven by hand) and the fake
engine process (bench/fake_engine_process.py): Wants from both load once and each gets its own channel; the unload
handshake keeps a model that one process answers busy for, resumes the quiet one, and unloads once both are quiet;
every process must close its channel before the engine goes; a failed load is Failed to both; ListModels; the idle
timeout unloads through the handshake; a process that lost its channel gets the model loaded again."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from server.config import ServerConfig
from server.fleet.catalog import scan
from server.fleet.control import (
    Activity,
    Closed,
    Control,
    Failed,
    FromOwner,
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
from server.fleet.owner import ModelOwner
from tests.helpers.processes import alive

pytestmark = pytest.mark.anyio


@pytest.fixture(autouse=True)
def fake_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPINDLE_ENGINE_COMMAND", "python -m bench.fake_engine_process")


def folder(tmp_path: Path) -> Path:
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text('{"vocab_size": 100, "max_position_embeddings": 64}')
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{}")
    (tmp_path / "models.yaml").write_text("broken:\n  dtype: float64\n")  # refused by the engine's config
    return tmp_path


class Api:
    """A stand-in API process: its control socket, and the engine channels it was given (by model)."""

    def __init__(self, control: Control) -> None:
        self.control = control
        self.channels: dict[str, socket.socket] = {}

    async def next(self) -> Any:
        got = await self.control.receive()
        assert got is not None
        msg, fd = got
        if isinstance(msg, Loaded):
            assert fd is not None
            self.channels[msg.model] = socket.socket(fileno=fd)
        return msg

    def close_channel(self, model: str) -> None:
        self.channels.pop(model).close()
        self.control.post(Closed(model))


@asynccontextmanager
async def owner_and_apis(tmp_path: Path, **settings: Any) -> AsyncIterator[tuple[ModelOwner, list[Api]]]:
    root = folder(tmp_path)
    pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(2)]
    config = ServerConfig.from_settings(models_dir=str(root), max_loaded_models=1, api_server_count=2, **settings)
    owner = ModelOwner(config, scan(root), [a.detach() for a, _ in pairs])
    apis = [Api(Control(b.detach(), FromOwner)) for _, b in pairs]
    async with anyio.create_task_group() as tg:
        for api in apis:
            tg.start_soon(api.control.run_writer)
        await tg.start(owner.run)
        with anyio.fail_after(60):
            yield owner, apis
        for api in apis:
            for sock in api.channels.values():
                sock.close()
            api.control.close()
        await owner.shutdown()
        tg.cancel_scope.cancel()


async def test_one_load_a_busy_answer_keeps_it_and_every_channel_closes_first(tmp_path: Path) -> None:
    async with owner_and_apis(tmp_path) as (owner, (p, q)):
        p.control.post(Want("a"))
        q.control.post(Want("a"))
        loaded = await p.next()
        assert loaded == await q.next()  # one Loaded each, one engine
        engine = loaded.pid
        assert owner.models["a"].status == "loaded"

        p.control.post(ListModels(7))
        assert await p.next() == Listing(7, ["a"])

        # b is wanted while a is busy in p: nothing happens until p says idle
        p.control.post(Activity("a", True))
        q.control.post(Want("b"))
        p.control.post(Activity("a", False))
        assert await p.next() == Quiesce("a") and await q.next() == Quiesce("a")
        p.control.post(Reply("a", True))
        q.control.post(Reply("a", False))  # a request came in q meanwhile
        assert await p.next() == Resume("a")  # p admits again; a stays
        q.control.post(Activity("a", False))  # q's request ended
        assert await p.next() == Quiesce("a") and await q.next() == Quiesce("a")
        p.control.post(Reply("a", True))
        q.control.post(Reply("a", True))
        assert await p.next() == Unload("a") and await q.next() == Unload("a")
        p.close_channel("a")
        await owner.until(lambda: owner.models["a"].closed == {0})
        assert alive(engine) and str(owner.models["a"].status) == "unloading"  # q still holds its channel
        q.close_channel("a")
        loaded_b = await p.next()
        assert loaded_b == await q.next() and loaded_b.model == "b"
        assert not alive(engine)


async def test_a_failed_load_is_failed_to_every_process_and_tried_again(tmp_path: Path) -> None:
    async with owner_and_apis(tmp_path) as (owner, (p, q)):
        for _ in range(2):  # each Want tries the load again
            p.control.post(Want("broken"))
            failed = await p.next()
            assert isinstance(failed, Failed) and "float64" in failed.why, failed
            assert await q.next() == failed
            await owner.until(lambda: owner.models["broken"].status == "unloaded")


async def unload_both(p: Api, q: Api, model: str) -> None:
    """The handshake answered quiet by both, then both channels closed."""
    assert await p.next() == Quiesce(model) and await q.next() == Quiesce(model)
    p.control.post(Reply(model, True))
    q.control.post(Reply(model, True))
    assert await p.next() == Unload(model) and await q.next() == Unload(model)
    p.close_channel(model)
    q.close_channel(model)


async def test_the_idle_timeout_unloads_through_the_handshake(tmp_path: Path) -> None:
    async with owner_and_apis(tmp_path, model_idle_timeout=0.3) as (owner, (p, q)):
        p.control.post(Want("a"))
        assert isinstance(await p.next(), Loaded) and isinstance(await q.next(), Loaded)
        p.control.post(Activity("a", True))
        await owner.until(lambda: owner.models["a"].busy == {0})
        p.control.post(Activity("a", False))
        await unload_both(p, q, "a")
        await owner.until(lambda: owner.models["a"].status == "unloaded")
        assert not owner.models["a"].wanted  # nobody asked: it stays unloaded


async def test_a_process_that_lost_its_channel_gets_the_model_back(tmp_path: Path) -> None:
    """q's own open failed: the model is unloaded once idle everywhere and loaded again for q's request."""
    async with owner_and_apis(tmp_path) as (owner, (p, q)):
        p.control.post(Want("a"))
        first = await p.next()
        assert first == await q.next()
        q.channels.pop("a").close()
        q.control.post(Lost("a", "its renderer failed"))
        q.control.post(Want("a"))  # a request there waits
        await unload_both_but_q_closed(p, q, "a")
        again = await p.next()
        assert again == await q.next() and isinstance(again, Loaded) and again.pid != first.pid


async def unload_both_but_q_closed(p: Api, q: Api, model: str) -> None:
    assert await p.next() == Quiesce(model) and await q.next() == Quiesce(model)
    p.control.post(Reply(model, True))
    q.control.post(Reply(model, True))  # nothing open there: quiet
    assert await p.next() == Unload(model) and await q.next() == Unload(model)
    p.close_channel(model)
    q.control.post(Closed(model))
