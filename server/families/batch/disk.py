"""The Batch API's disk: its folder, ids, atomic JSON writes, and the list pagination files and batches share."""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import tempfile
import time
from pathlib import Path
from typing import Any

from engine.cache_root import cache_root
from server.config import ServerConfig
from server.http.errors import APIError

MAX_LIST = 10_000  # OpenAI's cap on a files list's `limit`; batches cap at 100


def batch_root(config: ServerConfig) -> Path:
    """--batch-dir, else <spindle cache>/batches."""
    configured = config.batch.batch_dir
    return Path(configured) if configured else cache_root() / "batches"


_CLAIMED: list[int] = []  # the lock files' descriptors, held open for the process's life


def claim(root: Path) -> bool:
    """Take the batch folder's lock (an flock on <root>/.owner, released when the process exits); False when
    another process holds it."""
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / ".owner", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    _CLAIMED.append(fd)
    return True


def new_id(prefix: str) -> str:
    """Ids that sort by creation (lists break a tie within a second by id), then random."""
    return f"{prefix}{time.time_ns():016x}{secrets.token_hex(6)}"


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` so that a crash leaves the old file or the new one, never a torn one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: Path, value: dict[str, Any]) -> None:
    write_atomic(path, json.dumps(value).encode())


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_bytes())
    except (FileNotFoundError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def page(items: list[dict[str, Any]], after: str | None, limit: int) -> dict[str, Any]:
    """One page of `items` (newest first) after the item `after`, as OpenAI's cursor lists."""
    start = 0
    if after is not None:
        ids = [item["id"] for item in items]
        start = ids.index(after) + 1 if after in ids else len(items)
    data = items[start : start + limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": start + limit < len(items),
    }


def query_limit(query: dict[str, str], default: int, most: int) -> int:
    raw = query.get("limit")
    if raw is None:
        return default
    try:
        limit = int(raw)
    except ValueError:
        raise APIError(f"limit must be an integer; got {raw!r}", status=400, param="limit") from None
    if not 1 <= limit <= most:
        raise APIError(f"limit must be between 1 and {most}; got {limit}", status=400, param="limit")
    return limit


def newest_first(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(items, key=lambda item: (item["created_at"], item["id"]), reverse=True)
