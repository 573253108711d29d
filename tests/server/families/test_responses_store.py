"""The stored responses (server/families/responses/store.py): the LRU bound at, under and over the size, in
memory and in a file several processes share; cancel marks; items by id."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import msgspec
import pytest

from server.families.responses.store import ResponseStore, StoredResponse, SyncStore, connect
from server.fleet.catalog import scan
from server.fleet.stored import ModelStores
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


TURN = "x" * 13_000  # a 13 KB user turn


def chain(store: SyncStore, turns: int, first: int = 0) -> list[object]:
    """`turns` responses, each continuing the one before as the route stores them (the previous response's
    conversation, this input, this output); the last one's conversation."""
    history: list[object] = []
    for i in range(first, first + turns):
        previous = f"resp_{i - 1}" if i > first else None
        given = [{"role": "user", "content": f"{i}{TURN}"}]
        output = [{"id": f"msg_{i}", "type": "message", "content": [{"type": "output_text", "text": f"ok {i}"}]}]
        items = [*history, *given, *output]
        assert store.put(StoredResponse({"id": f"resp_{i}", "status": "completed"}, items, previous, len(history)))
        history = items
    return history


def held_bytes(store: SyncStore) -> int:
    """What the database takes: its pages (in memory, or the file's)."""
    pages = store.db.execute("PRAGMA page_count").fetchone()[0]
    return int(pages * store.db.execute("PRAGMA page_size").fetchone()[0])


@pytest.mark.parametrize("where", ["memory", "file"])
def test_a_chain_of_turns_stores_each_item_once(where: str, tmp_path: Path) -> None:
    store = SyncStore(":memory:" if where == "memory" else str(tmp_path / "r.sqlite3"), 4096)
    conversation = chain(store, 100)
    sent = len(msgspec.json.encode(conversation))  # every turn's bytes once: what the clients sent and got
    per_turn = held_bytes(store) / 100
    assert per_turn < 2 * sent / 100, (per_turn, sent / 100)  # was the whole conversation per turn: 50x at turn 100
    assert store.stored_bytes() < 1.2 * sent
    got = store.get("resp_99")
    assert got is not None and got.items == conversation
    got = store.get("resp_49")
    assert got is not None and got.items == conversation[:100]


def test_an_evicted_turn_keeps_its_items_while_a_later_turn_needs_them() -> None:
    store = SyncStore(":memory:", 3)
    conversation = chain(store, 10)  # the size keeps the last 3: the first 7 are hidden, their items kept
    assert len(store) == 3 and store.get("resp_6") is None and store.get("resp_7") is not None
    got = store.get("resp_9")
    assert got is not None and got.items == conversation
    assert store.item("msg_0") == conversation[1]  # an item of an evicted turn that a stored one holds
    for i in (7, 8, 9):
        assert store.delete(f"resp_{i}")
    assert store.stored_bytes() == 0 and store.db.execute("SELECT COUNT(*) FROM responses").fetchone()[0] == 0
    assert store.item("msg_0") is None
    chain(store, 3, first=20)
    assert store.delete("resp_20") and store.get("resp_22") is not None  # the middle of a chain: hidden, not lost
    assert store.get("resp_20") is None and not store.delete("resp_20")


def test_the_bytes_cap_evicts_the_least_recent_and_refuses_a_conversation_over_it() -> None:
    store = SyncStore(":memory:", 100, max_bytes=60_000)
    chain(store, 3)  # about 40 KB
    chain(store, 2, first=10)  # over 60 KB: the least recent go, their chain with them
    assert store.stored_bytes() <= 60_000
    assert store.get("resp_0") is None and store.get("resp_11") is not None
    before = store.stored_bytes()
    big = StoredResponse({"id": "resp_big", "status": "completed"}, [{"role": "user", "content": "y" * 70_000}])
    with pytest.raises(APIError) as e:
        store.put(big)
    assert e.value.status == 400 and "--responses-store-max-bytes (60000)" in e.value.message
    assert store.get("resp_big") is None and store.stored_bytes() == before  # nothing stored, nothing evicted


def test_each_models_store_takes_the_servers_byte_cap_or_its_own(tmp_path: Path) -> None:
    """--models-dir: every model's store gets --responses-store-max-bytes, unless models.yaml gives it one."""
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    (tmp_path / "models.yaml").write_text("b:\n  responses-store-max-bytes: 1KiB\n")
    stores = ModelStores(scan(tmp_path), 5, None, 2000).stores
    assert (stores["a"].max_bytes, stores["b"].max_bytes) == (2000, 1024)
