"""The KV disk store alone: its LRU size bound, damaged / foreign / truncated files ignored and deleted, and writes
from its thread while another thread reads."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest

from engine.core import kv_offload
from engine.core.kv_disk_store import _HEADER, KVDiskStore, file_name
from engine.core.kv_offload import fitted_bound

PAYLOAD = 1000


def entry_size(key: str) -> int:
    return _HEADER.size + len(key.encode()) + PAYLOAD


def fill(store: KVDiskStore, keys: list[str]) -> None:
    for k in keys:
        assert store.put(k, bytes([len(k) % 256]) * PAYLOAD)
        store.flush()


def test_lru_bound_at_under_and_over_the_size(tmp_path: Path) -> None:
    keys = [f"m:k{i}" for i in range(5)]
    size = entry_size(keys[0])
    store = KVDiskStore(tmp_path, 3 * size)  # exactly three files fit
    fill(store, keys[:3])
    assert len(store) == 3 and store.num_bytes == 3 * size  # at the bound: all kept
    assert store.get(keys[0], PAYLOAD) is not None  # k0 used: k1 is now the least recently used
    fill(store, keys[3:4])  # over: one goes
    assert keys[1] not in store and keys[0] in store and keys[3] in store
    assert not (tmp_path / file_name(keys[1])).exists()
    assert store.num_bytes == 3 * size == sum(p.stat().st_size for p in tmp_path.iterdir())
    assert not store.put("m:big", b"x" * (3 * size))  # larger than the whole store: never written
    for t, k in enumerate([keys[2], keys[0], keys[3]]):  # file times are coarse: spell out the use order
        os.utime(tmp_path / file_name(k), ns=(t * 10**9, t * 10**9))
    again = KVDiskStore(tmp_path, 2 * size)  # a restart under a smaller bound keeps the most recently used
    assert len(again) == 2 and keys[2] not in again and keys[3] in again and keys[0] in again
    again.close()
    store.close()


def test_damaged_foreign_and_truncated_files_are_deleted(tmp_path: Path) -> None:
    store = KVDiskStore(tmp_path, 1 << 20)
    keys = ["m:flip", "m:cut", "m:magic", "m:other", "m:ok"]
    fill(store, keys)
    path = {k: tmp_path / file_name(k) for k in keys}
    data = bytearray(path["m:flip"].read_bytes())
    data[-1] ^= 0xFF  # checksum no longer matches
    path["m:flip"].write_bytes(data)
    path["m:cut"].write_bytes(path["m:cut"].read_bytes()[:-10])
    path["m:magic"].write_bytes(b"NOTSPKV!" + path["m:magic"].read_bytes()[8:])
    path["m:other"].write_bytes(path["m:ok"].read_bytes())  # another key's file under this name
    for k in keys[:4]:
        assert store.get(k, PAYLOAD) is None, k
        assert not path[k].exists() and k not in store
    assert store.get("m:ok", PAYLOAD + 1) is None  # the wrong size for this model's blocks: not trusted either
    assert store.get("m:fresh", PAYLOAD) is None
    store.close()
    (tmp_path / "junk.kvb").write_bytes(b"short")
    again = KVDiskStore(tmp_path, 1 << 20)
    assert again.get("m:junk", PAYLOAD) is None
    again.close()


def test_writes_and_reads_at_once(tmp_path: Path) -> None:
    store = KVDiskStore(tmp_path, 40 * entry_size("m:k00"), queue_depth=8)
    done = threading.Event()
    bad: list[str] = []

    def reader() -> None:
        while not done.is_set():
            for i in range(100):
                got = store.get(f"m:k{i:02d}", PAYLOAD)
                if got is not None and got != bytes([i]) * PAYLOAD:
                    bad.append(f"m:k{i:02d}")

    t = threading.Thread(target=reader)
    t.start()
    written = 0
    for i in range(100):
        written += store.put(f"m:k{i:02d}", bytes([i]) * PAYLOAD)
    store.flush()
    done.set()
    t.join()
    assert not bad
    assert written + store.dropped == 100 and store.num_bytes <= store.max_bytes
    assert len(list(tmp_path.glob("*.tmp"))) == 0
    store.close()


def test_the_bound_is_fitted_to_a_tenth_of_the_free_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a.kvb").write_bytes(b"x" * 500)  # the store's own files count as room it may keep
    (tmp_path / "other").write_bytes(b"x" * 9000)  # anything else does not
    usage = shutil.disk_usage(tmp_path)._replace(free=9_500)
    monkeypatch.setattr(kv_offload.shutil, "disk_usage", lambda _: usage)
    assert fitted_bound(tmp_path, 999) == 999  # under a tenth of (free + held) = 1000: as asked
    assert fitted_bound(tmp_path, 1000) == 1000  # at it
    assert fitted_bound(tmp_path, 1001) == 1000  # over it: the tenth
    assert fitted_bound(tmp_path, 0) == 0  # off stays off
    assert fitted_bound(tmp_path / "new", 4 << 30) == 950  # a folder made on first use
