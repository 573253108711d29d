"""The stored responses (server/families/responses/store.py): the LRU bound at, under and over the size, in
memory and in a file several processes share; cancel marks; items by id."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

from server.families.responses.store import ResponseStore, StoredResponse, SyncStore, connect
from server.http.errors import APIError

pytestmark = pytest.mark.anyio


def entry(i: int, status: str = "completed", items: list[object] | None = None) -> StoredResponse:
    return StoredResponse(
        {"id": f"resp_{i}", "status": status}, [{"role": "user", "content": str(i)}] if items is None else items
    )


@pytest.fixture(params=["memory", "file"])
def directory(request: pytest.FixtureRequest, tmp_path: Path) -> str | None:
    return None if request.param == "memory" else str(tmp_path)


@pytest.mark.parametrize("size", [1, 2, 3])
async def test_the_least_recently_used_goes_first(size: int, directory: str | None) -> None:
    store = ResponseStore(size, directory)
    for i in range(size - 1):
        await store.put(entry(i))
    assert await store.length() == size - 1  # under the bound: all kept
    await store.put(entry(size - 1))
    assert await store.length() == size  # at the bound: all kept
    await store.get("resp_0")  # used: now the most recent
    await store.put(entry(size))  # over the bound: the least recently used goes
    assert await store.length() == size
    gone = "resp_1" if size > 1 else "resp_0"
    with pytest.raises(APIError) as e:
        await store.get(gone)
    assert e.value.status == 404
    assert (await store.get(f"resp_{size}")).items == [{"role": "user", "content": str(size)}]
    if size > 1:
        assert (await store.get("resp_0")).response == {"id": "resp_0", "status": "completed"}


async def test_size_zero_stores_nothing_and_delete_is_a_404_twice(directory: str | None) -> None:
    empty = ResponseStore(0, directory)
    await empty.put(entry(0))
    assert await empty.length() == 0
    store = ResponseStore(2, directory)
    await store.put(entry(0))
    await store.delete("resp_0")
    with pytest.raises(APIError) as e:
        await store.delete("resp_0")
    assert e.value.status == 404


async def test_history_needs_a_finished_response() -> None:
    store = ResponseStore(4)
    await store.put(entry(0, "incomplete"))
    await store.put(entry(1, "queued"))
    assert await store.history("resp_0") == [{"role": "user", "content": "0"}]
    with pytest.raises(APIError) as e:
        await store.history("resp_1")
    assert (e.value.status, e.value.param) == (400, "previous_response_id")
    with pytest.raises(APIError) as e:
        await store.history("resp_9")
    assert (e.value.status, e.value.param) == (404, "previous_response_id")


async def test_cancel_marks_an_active_response_and_its_end_is_not_stored_over_it() -> None:
    store = ResponseStore(4)
    await store.put(entry(0, "queued"))
    await store.put(entry(1, "completed"))
    assert await store.cancelled(["resp_0", "resp_1"]) == []
    assert (await store.cancel("resp_0")) == {"id": "resp_0", "status": "cancelled"}
    assert (await store.cancel("resp_1")) == {"id": "resp_1", "status": "completed"}  # finished: as it is
    assert await store.cancel("resp_9") is None
    assert await store.cancelled(["resp_0", "resp_1"]) == ["resp_0"]
    assert not await store.put(entry(0, "completed"))  # the generation ending after the cancel
    assert (await store.get("resp_0")).response["status"] == "cancelled"


async def test_items_are_found_by_id_while_a_response_holding_them_is_stored() -> None:
    store = ResponseStore(2)
    call = {"id": "fc_1", "type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}
    await store.put(entry(0, items=[{"role": "user", "content": "hi"}, call]))
    await store.put(entry(1, items=[{"role": "user", "content": "hi"}, call, {"id": "msg_2", "type": "message"}]))
    assert await store.item("fc_1", "input[0].id") == call
    await store.delete("resp_1")
    assert await store.item("fc_1", "input[0].id") == call  # resp_0 holds it still
    with pytest.raises(APIError) as e:
        await store.item("msg_2", "input[3].id")
    assert (e.value.status, e.value.param) == (404, "input[3].id")
    await store.put(entry(2))
    await store.put(entry(3))  # resp_0 evicted: its items go with it
    with pytest.raises(APIError):
        await store.item("fc_1", "input[0].id")


def _writer(path: str, first: int, count: int, size: int) -> None:
    store = SyncStore(path, size)
    for i in range(first, first + count):
        assert store.put(entry(i))
    store.close()


def test_two_processes_writing_at_once_share_one_bounded_store(tmp_path: Path) -> None:
    path = str(tmp_path / "responses.sqlite3")
    connect(path).close()
    ctx = multiprocessing.get_context("spawn")  # no sqlite connection inherited across a fork
    procs = [ctx.Process(target=_writer, args=(path, first, 300, 50)) for first in (0, 1000)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0  # no write was lost to a lock
    store = SyncStore(path, 50)
    assert len(store) == 50  # the bound holds over both writers
    for first in (0, 1000):  # what each writer still has is its most recent entries: LRU over both
        kept = [i for i in range(first, first + 300) if store.get(f"resp_{i}") is not None]
        assert kept == list(range(first + 300 - len(kept), first + 300)), kept
    # which writer ended last depends on the scheduler (under load one may evict all the other's entries)
    other = SyncStore(path, 50)  # what one process stores another reads, and a delete is seen by both
    assert store.put(entry(2000)) and other.get("resp_2000") is not None and other.delete("resp_2000")
    assert store.get("resp_2000") is None
    assert store.put(entry(7)) and other.get("resp_7") is not None
