"""The stored responses' LRU (server/api/openai/responses_store.py): its bound at, under and over the size."""

from __future__ import annotations

import pytest

from server.api.openai.responses_store import ResponseStore, StoredResponse
from server.http.errors import APIError


def entry(i: int, status: str = "completed") -> StoredResponse:
    return StoredResponse({"id": f"resp_{i}", "status": status}, [{"role": "user", "content": str(i)}])


@pytest.mark.parametrize("size", [1, 2, 3])
def test_the_least_recently_used_goes_first(size: int) -> None:
    store = ResponseStore(size)
    for i in range(size):
        store.put(entry(i))
    assert len(store) == size  # at the bound: all kept
    store.get("resp_0")  # used: now the most recent
    store.put(entry(size))  # over the bound: the least recently used goes
    assert len(store) == size
    gone = "resp_1" if size > 1 else "resp_0"
    with pytest.raises(APIError) as e:
        store.get(gone)
    assert e.value.status == 404
    assert store.get(f"resp_{size}").items == [{"role": "user", "content": str(size)}]


def test_size_zero_stores_nothing_and_delete_is_a_404_twice() -> None:
    empty = ResponseStore(0)
    empty.put(entry(0))
    assert len(empty) == 0
    store = ResponseStore(2)
    store.put(entry(0))
    store.delete("resp_0")
    with pytest.raises(APIError) as e:
        store.delete("resp_0")
    assert e.value.status == 404


def test_history_needs_a_finished_response() -> None:
    store = ResponseStore(4)
    store.put(entry(0, "incomplete"))
    store.put(entry(1, "queued"))
    assert store.history("resp_0") == [{"role": "user", "content": "0"}]
    with pytest.raises(APIError) as e:
        store.history("resp_1")
    assert (e.value.status, e.value.param) == (400, "previous_response_id")
    with pytest.raises(APIError) as e:
        store.history("resp_9")
    assert (e.value.status, e.value.param) == (404, "previous_response_id")
