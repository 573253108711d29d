"""server/fleet/follower.py with stand-in model apps and a hand-driven owner on its control socket: a request sends
Want and waits; Failed is its 503; Loaded opens the app; busy / idle reported; Quiesce answered from the state here
(quiet holds new requests until Resume); Unload closes the app, then Closed; SIGTERM's drain ends a waiting request
at once; /v1/models asks the owner."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
from prometheus_client import CollectorRegistry

from server.config import ServerConfig
from server.fleet.catalog import scan
from server.fleet.control import (
    Activity,
    Closed,
    Control,
    Failed,
    Listing,
    ListModels,
    Loaded,
    Quiesce,
    Reply,
    Resume,
    ToOwner,
    Unload,
    Want,
)
from server.fleet.follower import FollowerRegistry
from server.fleet.loaded_set import RegistryMetrics
from server.http.errors import APIError
from tests.server.fleet.test_loaded_set import Models

pytestmark = pytest.mark.anyio


@asynccontextmanager
async def follower(tmp_path: Path) -> AsyncIterator[tuple[FollowerRegistry, Control]]:
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    config = ServerConfig.from_settings(models_dir=str(tmp_path), api_server_count=2)
    reg = FollowerRegistry(
        config, scan(tmp_path), Models().make_app, RegistryMetrics(CollectorRegistry()), theirs.detach()
    )
    owner = Control(ours.detach(), ToOwner)
    async with anyio.create_task_group() as tg:
        tg.start_soon(owner.run_writer)
        await tg.start(reg.run)
        with anyio.fail_after(30):
            yield reg, owner
        tg.cancel_scope.cancel()
    owner.close()


async def said(owner: Control) -> Any:
    got = await owner.receive()
    assert got is not None
    return got[0]


def channel_end() -> int:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.close()
    return b.detach()


async def test_want_failed_loaded_and_the_activity_reports(tmp_path: Path) -> None:
    async with follower(tmp_path) as (reg, owner), anyio.create_task_group() as tg:
        slot = reg.slots["a"]
        errors: list[APIError] = []
        failed, entered = anyio.Event(), anyio.Event()

        async def request() -> None:
            try:
                await reg.acquire(slot)
            except APIError as e:
                errors.append(e)
            failed.set()

        tg.start_soon(request)
        assert await said(owner) == Want("a")
        owner.post(Failed("a", "no weights"))
        await failed.wait()
        assert errors[0].status == 503 and "no weights" in errors[0].message

        async def served() -> None:
            await reg.acquire(slot)
            entered.set()

        tg.start_soon(served)
        assert await said(owner) == Want("a")  # the next request tries again
        owner.post(Loaded("a", 1), channel_end())
        assert await said(owner) == Activity("a", True)  # opening here
        await entered.wait()
        reg.release(slot)
        assert await said(owner) == Activity("a", False)

        owner.post(Listing(99, []))  # a stray listing (its asker gone) is ignored
        names: list[set[str]] = []
        listed = anyio.Event()

        async def listing() -> None:
            names.append(await reg.loaded_names())
            listed.set()

        tg.start_soon(listing)
        asked = await said(owner)
        assert isinstance(asked, ListModels), asked
        owner.post(Listing(asked.ticket, ["a"]))
        await listed.wait()
        assert names == [{"a"}]


async def test_quiesce_holds_new_requests_and_unload_closes(tmp_path: Path) -> None:
    async with follower(tmp_path) as (reg, owner), anyio.create_task_group() as tg:
        slot = reg.slots["a"]
        reg.control.post(Want("a"))  # (as a request would)
        assert await said(owner) == Want("a")
        owner.post(Loaded("a", 1), channel_end())
        assert await said(owner) == Activity("a", True)
        assert await said(owner) == Activity("a", False)  # opened, idle

        await reg.acquire(slot)  # a request inside: busy
        assert await said(owner) == Activity("a", True)
        owner.post(Quiesce("a"))
        assert await said(owner) == Reply("a", False)
        reg.release(slot)
        assert await said(owner) == Activity("a", False)

        owner.post(Quiesce("a"))
        assert await said(owner) == Reply("a", True)
        assert slot.status == "quiet"
        entered = anyio.Event()

        async def held() -> None:
            await reg.acquire(slot)
            entered.set()
            reg.release(slot)

        tg.start_soon(held)
        assert await said(owner) == Want("a")  # it waits, and asks for the model
        assert not entered.is_set()
        owner.post(Resume("a"))
        await entered.wait()
        assert await said(owner) == Activity("a", True)
        assert await said(owner) == Activity("a", False)

        owner.post(Quiesce("a"))
        assert await said(owner) == Reply("a", True)
        owner.post(Unload("a"))
        assert await said(owner) == Closed("a")
        assert str(slot.status) == "unloaded"


async def test_the_drain_ends_a_request_waiting_for_a_load(tmp_path: Path) -> None:
    async with follower(tmp_path) as (reg, owner), anyio.create_task_group() as tg:
        errors: list[APIError] = []
        failed = anyio.Event()

        async def request() -> None:
            try:
                await reg.acquire(reg.slots["b"])
            except APIError as e:
                errors.append(e)
            failed.set()

        tg.start_soon(request)
        assert await said(owner) == Want("b")
        assert await reg.drain(5) == 0
        await failed.wait()
        assert errors[0].status == 503
