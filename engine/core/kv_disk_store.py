"""A bounded on-disk store of full KV blocks, LRU by use, one file per block (docs/subsystems/kv-disk-cache.md).

A file is `<sha256(key)[:32]>.kvb`: a header (magic, version, key length, payload length, payload checksum), the key
itself and the payload. A file whose header, key, length or checksum disagrees with what is asked for is deleted
and reported as missing, never trusted. Writes go through one writer thread fed by a bounded queue (a full queue
drops the block: the store is a cache); reads are synchronous and the caller bounds how many it makes per step.
"""

from __future__ import annotations

import hashlib
import os
import queue
import struct
import threading
from collections import OrderedDict
from pathlib import Path

MAGIC = b"SPKVBLK\0"
VERSION = 1
_HEADER = struct.Struct("<8sHHIQ16s")  # magic, version, reserved, key length, payload length, blake2b-128 of payload
_SUFFIX = ".kvb"


def _checksum(payload: bytes | memoryview) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


def file_name(key: str) -> str:
    """The file a key is stored in (the key itself is in the header and checked on every read)."""
    return hashlib.sha256(key.encode()).hexdigest()[:32] + _SUFFIX


class KVDiskStore:
    """Blocks by key under `folder`, at most `max_bytes` in all (files included whole: header and payload)."""

    def __init__(self, folder: Path, max_bytes: int, queue_depth: int = 64) -> None:
        if max_bytes < 0:
            raise ValueError(f"the KV disk store's size must not be negative, got {max_bytes}")
        self.folder = folder
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._files: OrderedDict[str, int] = OrderedDict()  # file name -> bytes, least recently used first
        self._bytes = 0
        self._pending: set[str] = set()  # queued for writing
        self._queue: queue.Queue[tuple[str, bytes] | None] = queue.Queue(maxsize=queue_depth)
        self.dropped = 0  # writes dropped because the queue was full
        folder.mkdir(parents=True, exist_ok=True)
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
        self._writer.start()

    def _scan(self) -> None:
        """The files already there, oldest use first (a hit touches its file's mtime, so LRU survives a restart)."""
        found = []
        for p in self.folder.glob("*" + _SUFFIX):
            try:
                st = p.stat()
            except OSError:
                continue
            found.append((st.st_mtime_ns, p.name, st.st_size))
        for _, name, size in sorted(found):
            self._files[name] = size
            self._bytes += size
        with self._lock:
            self._evict_over(0)

    # ---- queries ----------------------------------------------------------------------------
    def __contains__(self, key: str) -> bool:
        name = file_name(key)
        with self._lock:
            return name in self._files or name in self._pending

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._files)

    def can_take(self) -> bool:
        """Whether a write would be queued now (the caller skips copying a block out when not)."""
        return self.max_bytes > 0 and not self._queue.full()

    # ---- writing ---------------------------------------------------------------------------
    def put(self, key: str, payload: bytes) -> bool:
        """Queue a block for writing; False (dropped) when the queue is full, the key is there or it cannot fit."""
        name = file_name(key)
        size = _HEADER.size + len(key.encode()) + len(payload)
        with self._lock:
            if name in self._files or name in self._pending or size > self.max_bytes:
                return False
            self._pending.add(name)
        try:
            self._queue.put_nowait((key, payload))
        except queue.Full:
            with self._lock:
                self._pending.discard(name)
            self.dropped += 1
            return False
        return True

    def flush(self) -> None:
        """Wait until every queued write is on disk (tests, shutdown)."""
        self._queue.join()

    def close(self) -> None:
        self._queue.put(None)
        self._writer.join()

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
            finally:
                self._queue.task_done()

    def _write(self, key: str, payload: bytes) -> None:
        kb = key.encode()
        name = file_name(key)
        data = _HEADER.pack(MAGIC, VERSION, 0, len(kb), len(payload), _checksum(payload)) + kb + payload
        path = self.folder / name
        tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            tmp.write_bytes(data)
            os.replace(tmp, path)  # a reader never sees half a file under the block's name
        except OSError:
            tmp.unlink(missing_ok=True)
            with self._lock:
                self._pending.discard(name)
            return
        with self._lock:
            self._pending.discard(name)
            old = self._files.pop(name, 0)
            self._files[name] = len(data)
            self._bytes += len(data) - old
            self._evict_over(0)

    def _evict_over(self, room: int) -> None:
        """Delete least recently used files until the total plus `room` fits (called under the lock)."""
        while self._files and self._bytes + room > self.max_bytes:
            name, size = self._files.popitem(last=False)
            self._bytes -= size
            (self.folder / name).unlink(missing_ok=True)

    # ---- reading ---------------------------------------------------------------------------
    def get(self, key: str, payload_size: int) -> bytes | None:
        """The payload stored under key, or None; a damaged or foreign file is deleted."""
        name = file_name(key)
        with self._lock:
            if name not in self._files:
                return None
            self._files.move_to_end(name)
        path = self.folder / name
        try:
            data = path.read_bytes()
        except OSError:
            self._forget(name)
            return None
        payload = self._check(data, key.encode(), payload_size)
        if payload is None:
            self._forget(name)
            path.unlink(missing_ok=True)
            return None
        try:
            os.utime(path)  # the LRU order a restart reads back
        except OSError:
            pass
        return payload

    @staticmethod
    def _check(data: bytes, kb: bytes, payload_size: int) -> bytes | None:
        """The payload if the header's magic, version, key, length and checksum all match, else None."""
        if len(data) < _HEADER.size:
            return None
        magic, version, _, klen, plen, digest = _HEADER.unpack_from(data)
        start = _HEADER.size + klen
        if magic != MAGIC or version != VERSION or plen != payload_size or len(data) != start + plen:
            return None
        if data[_HEADER.size : start] != kb:
            return None
        payload = data[start:]
        return payload if _checksum(payload) == digest else None

    def _forget(self, name: str) -> None:
        with self._lock:
            size = self._files.pop(name, None)
            if size is not None:
                self._bytes -= size
