"""Stored responses (`store: true`): a bounded LRU (--responses-store-size entries, --responses-store-max-bytes)
in one SQLite database that every API process of --api-server-count opens, so a stored id is found (GET, DELETE,
cancel, previous_response_id, item_reference) whichever process a request lands on. An evicted or deleted id is a
404.

Each row keeps a response object and the items it added to its conversation (its input and output); the items
before them are its parent's (the previous_response_id it continued), so a chain of turns stores each item once.
A response evicted or deleted while a stored one continues it keeps its row, hidden (no response, only its items,
for the chain), until no stored response needs it.

The database is a file in a directory the launcher makes and removes (server/runtime/launcher.py, WorkerContext.
responses_dir), in WAL mode so readers never wait for a writer; a single server keeps it in memory. Every call
runs in a worker thread (sqlite3 blocks), one at a time per process over one connection; across processes
SQLite's own locking orders writers (a write waits at most BUSY_TIMEOUT_S for another's, then 503). Recency is
a counter in the table, so the least recently used entry is the same for every process.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import anyio
import msgspec

from server.http import unavailable
from server.http.errors import APIError

DB_NAME = "responses.sqlite3"
BUSY_TIMEOUT_S = 5.0
ACTIVE = ("queued", "in_progress")  # a background response still generating: it can be cancelled
T = TypeVar("T")

DEFAULT_MAX_BYTES = 256 << 20
# visible 0: a hidden row, kept for its items only; length: items in the conversation through the row
_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (id TEXT PRIMARY KEY, used INTEGER NOT NULL, status TEXT NOT NULL,
                                      response BLOB, items BLOB NOT NULL, parent TEXT, length INTEGER NOT NULL,
                                      bytes INTEGER NOT NULL, visible INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS responses_used ON responses (visible, used);
CREATE INDEX IF NOT EXISTS responses_parent ON responses (parent);
CREATE TABLE IF NOT EXISTS items (item_id TEXT NOT NULL, response_id TEXT NOT NULL,
                                  PRIMARY KEY (item_id, response_id));
CREATE INDEX IF NOT EXISTS items_response ON items (response_id);
"""


@dataclass
class StoredResponse:
    response: dict[str, Any]
    items: list[Any]  # the conversation's items through this response's output
    previous: str | None = None  # the response it continued (previous_response_id): its items begin `items` ...
    shared: int = 0  # ... this many of them, stored once, with it


def not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(f"Response with id '{response_id}' not found.", status=404, param=param)


def connect(path: str) -> sqlite3.Connection:
    """A connection to the store at `path` (":memory:": this process only), its tables made if missing."""
    db = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
    if path != ":memory:":
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")  # a lost response on power loss is acceptable; fsyncs are not
    db.executescript("BEGIN IMMEDIATE;" + _SCHEMA + "COMMIT;")  # two processes making the tables: in turn
    return db


class SyncStore:
    """The store's operations, blocking (each one transaction); ResponseStore runs them off the event loop."""

    def __init__(self, path: str, size: int, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.size, self.max_bytes = size, max_bytes
        self.db = connect(path)

    def _write(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        self.db.execute("BEGIN IMMEDIATE")  # take the write lock first: no deadlock upgrading a read
        try:
            out = fn(self.db)
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")
        return out

    def __len__(self) -> int:
        return int(self.db.execute("SELECT COUNT(*) FROM responses WHERE visible = 1").fetchone()[0])

    def stored_bytes(self) -> int:
        """The bytes the rows hold (responses and items, hidden rows' too): what --responses-store-max-bytes caps."""
        return int(self.db.execute("SELECT COALESCE(SUM(bytes), 0) FROM responses").fetchone()[0])

    def put(self, entry: StoredResponse) -> bool:
        """Store (or replace) `entry`, the most recent now; the least recent go past the size or the bytes. A
        cancelled response stays cancelled: False then (the generation it stopped may still try to store its end).
        APIError (400) when its conversation alone is over the bytes: nothing is stored then."""
        if self.size == 0:
            return False
        rid = entry.response["id"]

        def put(db: sqlite3.Connection) -> bool:
            row = db.execute("SELECT status FROM responses WHERE id = ?", (rid,)).fetchone()
            if row is not None and row[0] == "cancelled":
                return False
            if row is not None:
                _drop_row(db, rid)  # replaced: a background response's end over its queued state
            _insert(db, entry)
            over = db.execute(
                "SELECT id FROM responses WHERE visible = 1 ORDER BY used DESC LIMIT -1 OFFSET ?", (self.size,)
            ).fetchall()
            for (gone,) in over:
                _remove(db, gone)
            self._fit(db, rid)
            return True

        return self._write(put)

    def _fit(self, db: sqlite3.Connection, rid: str) -> None:
        """Evict the least recently used responses until the rows fit the bytes (400 if `rid`'s chain alone cannot)."""
        while (total := int(db.execute("SELECT SUM(bytes) FROM responses").fetchone()[0])) > self.max_bytes:
            lru = db.execute(
                "SELECT id FROM responses WHERE visible = 1 AND id != ? ORDER BY used LIMIT 1", (rid,)
            ).fetchone()
            if lru is None:
                raise APIError(
                    f"The response's conversation is {total} bytes, over --responses-store-max-bytes "
                    f"({self.max_bytes}): it cannot be stored; send store: false or a shorter conversation.",
                    status=400,
                    param="store",
                )
            _remove(db, lru[0])

    def get(self, response_id: str) -> StoredResponse | None:
        """The entry, its items the whole conversation through it (now the most recent), None: not stored."""

        def get(db: sqlite3.Connection) -> tuple[bytes, list[Any]] | None:
            row = db.execute("SELECT response FROM responses WHERE id = ? AND visible = 1", (response_id,)).fetchone()
            if row is None:
                return None
            db.execute("UPDATE responses SET used = (SELECT MAX(used) + 1 FROM responses) WHERE id = ?", (response_id,))
            return bytes(row[0]), _conversation(db, response_id)

        found = self._write(get)
        return None if found is None else StoredResponse(msgspec.json.decode(found[0]), found[1])

    def delete(self, response_id: str) -> bool:
        return self._write(lambda db: _remove(db, response_id))

    def item(self, item_id: str) -> Any | None:
        """A stored conversation's item by its id (the most recent row that holds it), None: none."""
        row = self.db.execute(
            "SELECT r.items FROM items i JOIN responses r ON r.id = i.response_id "
            "WHERE i.item_id = ? ORDER BY r.used DESC LIMIT 1",
            (item_id,),
        ).fetchone()
        if row is None:
            return None
        return next(
            (it for it in msgspec.json.decode(row[0]) if isinstance(it, dict) and it.get("id") == item_id), None
        )

    def cancel(self, response_id: str) -> dict[str, Any] | None:
        """Mark an active response cancelled (its owner stops it: `cancelled`); the response as it now stands."""

        def cancel(db: sqlite3.Connection) -> bytes | None:
            row = db.execute(
                "SELECT response, status FROM responses WHERE id = ? AND visible = 1", (response_id,)
            ).fetchone()
            if row is None or row[1] not in ACTIVE:
                return None if row is None else bytes(row[0])
            response = {**msgspec.json.decode(row[0]), "status": "cancelled"}
            blob = msgspec.json.encode(response)
            db.execute(
                "UPDATE responses SET status = 'cancelled', response = ?, bytes = bytes + ? WHERE id = ?",
                (blob, len(blob) - len(row[0]), response_id),
            )
            return blob

        blob = self._write(cancel)
        return None if blob is None else dict(msgspec.json.decode(blob))

    def cancelled(self, ids: list[str]) -> list[str]:
        """Which of `ids` are marked cancelled (by any process)."""
        marks = ",".join("?" * len(ids))
        rows = self.db.execute(
            f"SELECT id FROM responses WHERE status = 'cancelled' AND visible = 1 AND id IN ({marks})", ids
        )
        return [r[0] for r in rows.fetchall()]

    def close(self) -> None:
        self.db.close()


def _insert(db: sqlite3.Connection, entry: StoredResponse) -> None:
    """`entry` as a row of the items it adds, linked to its parent's row when that row still holds the rest."""
    rid, items = entry.response["id"], entry.items
    parent = None
    if entry.previous is not None and entry.shared:
        row = db.execute("SELECT length FROM responses WHERE id = ?", (entry.previous,)).fetchone()
        if row is not None and row[0] == entry.shared:
            parent, items = entry.previous, items[entry.shared :]
    blobs = msgspec.json.encode(entry.response), msgspec.json.encode(items)
    db.execute(
        "INSERT INTO responses VALUES (?, (SELECT COALESCE(MAX(used), 0) + 1 FROM responses), ?, ?, ?, ?, ?, ?, 1)",
        (rid, entry.response["status"], *blobs, parent, len(entry.items), len(blobs[0]) + len(blobs[1])),
    )
    db.executemany(
        "INSERT OR REPLACE INTO items VALUES (?, ?)",
        [(item["id"], rid) for item in items if isinstance(item, dict) and isinstance(item.get("id"), str)],
    )


def _conversation(db: sqlite3.Connection, response_id: str) -> list[Any]:
    """The items of the row and of its ancestors, oldest first."""
    rows = db.execute(
        "WITH RECURSIVE chain(id, parent, items, depth) AS (SELECT id, parent, items, 0 FROM responses WHERE id = ? "
        "UNION ALL SELECT r.id, r.parent, r.items, c.depth + 1 FROM responses r JOIN chain c ON r.id = c.parent) "
        "SELECT items FROM chain ORDER BY depth DESC",
        (response_id,),
    ).fetchall()
    return [item for (blob,) in rows for item in msgspec.json.decode(blob)]


def _drop_row(db: sqlite3.Connection, row_id: str) -> str | None:
    """Delete the row and its item index; its parent's id."""
    row = db.execute("SELECT parent FROM responses WHERE id = ?", (row_id,)).fetchone()
    db.execute("DELETE FROM responses WHERE id = ?", (row_id,))
    db.execute("DELETE FROM items WHERE response_id = ?", (row_id,))
    return None if row is None else row[0]


def _remove(db: sqlite3.Connection, response_id: str) -> bool:
    """The response no longer stored: its row hidden while a row continues it, else deleted with the hidden
    ancestors only it needed."""
    if db.execute("SELECT 1 FROM responses WHERE id = ? AND visible = 1", (response_id,)).fetchone() is None:
        return False
    if db.execute("SELECT 1 FROM responses WHERE parent = ? LIMIT 1", (response_id,)).fetchone() is not None:
        db.execute(
            "UPDATE responses SET visible = 0, bytes = bytes - LENGTH(response), response = NULL WHERE id = ?",
            (response_id,),
        )
        return True
    parent = _drop_row(db, response_id)
    while (
        parent is not None
        and db.execute(
            "SELECT 1 FROM responses WHERE id = ? AND visible = 0 AND NOT EXISTS "
            "(SELECT 1 FROM responses WHERE parent = ?)",
            (parent, parent),
        ).fetchone()
    ):
        parent = _drop_row(db, parent)
    return True


class ResponseStore:
    """The routes' view: SyncStore's operations in a worker thread, one at a time, with the API's errors."""

    def __init__(self, size: int, directory: str | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.size, self.max_bytes = size, max_bytes
        self.path = ":memory:" if directory is None else str(Path(directory) / DB_NAME)
        self._sync: SyncStore | None = None  # opened on first use, in the serving process
        self._limiter = anyio.CapacityLimiter(1)  # one connection: its calls one at a time

    async def _run(self, fn: Callable[[SyncStore], T]) -> T:
        def call() -> T:
            if self._sync is None:
                self._sync = SyncStore(self.path, self.size, self.max_bytes)
            return fn(self._sync)

        try:
            return await anyio.to_thread.run_sync(call, limiter=self._limiter)
        except sqlite3.OperationalError as e:  # locked past BUSY_TIMEOUT_S by another process, or disk trouble
            raise unavailable.unavailable(f"The response store is unavailable: {e}.") from None

    async def length(self) -> int:
        return await self._run(len)

    async def put(self, entry: StoredResponse) -> bool:
        return await self._run(lambda s: s.put(entry))

    async def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        entry = await self._run(lambda s: s.get(response_id))
        if entry is None:
            raise not_found(response_id, param)
        return entry

    async def history(self, response_id: str) -> list[Any]:
        """The conversation `previous_response_id` continues: a 404 unknown, a 400 not finished."""
        entry = await self.get(response_id, "previous_response_id")
        status = entry.response["status"]
        if status not in ("completed", "incomplete"):
            raise APIError(
                f"Response '{response_id}' is {status}: only a completed or incomplete response can be continued.",
                status=400,
                param="previous_response_id",
            )
        return entry.items

    async def delete(self, response_id: str) -> None:
        if not await self._run(lambda s: s.delete(response_id)):
            raise not_found(response_id)

    async def item(self, item_id: str, param: str) -> Any:
        found = await self._run(lambda s: s.item(item_id))
        if found is None:
            raise APIError(f"Item with id '{item_id}' not found.", status=404, param=param)
        return found

    async def cancel(self, response_id: str) -> dict[str, Any] | None:
        return await self._run(lambda s: s.cancel(response_id))

    async def cancelled(self, ids: list[str]) -> list[str]:
        return await self._run(lambda s: s.cancelled(ids))
