"""Batches on disk: <batch dir>/batches/<id>.json (the batch object, replaced atomically at every change) and the
results so far, <id>.out.jsonl and <id>.err.jsonl, one appended line per answered request, from which a restart
knows which lines not to run again. Blocking: callers run it in a thread."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from server.families.batch.disk import new_id, newest_first, page, read_json, write_json
from server.http.errors import APIError

FINAL = ("completed", "failed", "expired", "cancelled")


def new_batch(input_file_id: str, endpoint: str, window: str, metadata: dict[str, str] | None) -> dict[str, Any]:
    now = int(time.time())
    return {
        "id": new_id("batch_"),
        "object": "batch",
        "endpoint": endpoint,
        "errors": None,
        "input_file_id": input_file_id,
        "completion_window": window,
        "status": "validating",
        "output_file_id": None,
        "error_file_id": None,
        "created_at": now,
        "in_progress_at": None,
        "expires_at": now + 24 * 3600,
        "finalizing_at": None,
        "completed_at": None,
        "failed_at": None,
        "expired_at": None,
        "cancelling_at": None,
        "cancelled_at": None,
        "request_counts": {"total": 0, "completed": 0, "failed": 0},
        "metadata": metadata,
    }


class BatchStore:
    def __init__(self, root: Path) -> None:
        self.dir = root / "batches"

    def path(self, batch_id: str, suffix: str) -> Path:
        if not batch_id or "/" in batch_id or batch_id.startswith("."):
            raise _missing(batch_id)
        return self.dir / f"{batch_id}{suffix}"

    def save(self, batch: dict[str, Any]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        write_json(self.path(batch["id"], ".json"), batch)

    def get(self, batch_id: str) -> dict[str, Any]:
        batch = read_json(self.path(batch_id, ".json"))
        if batch is None:
            raise _missing(batch_id)
        return batch

    def all(self) -> list[dict[str, Any]]:
        if not self.dir.is_dir():
            return []
        return [batch for path in self.dir.glob("*.json") if (batch := read_json(path)) is not None]

    def listing(self, after: str | None, limit: int) -> dict[str, Any]:
        return page(newest_first(self.all()), after, limit)

    def unfinished(self) -> list[dict[str, Any]]:
        return sorted((b for b in self.all() if b["status"] not in FINAL), key=lambda b: b["created_at"])

    def reset_results(self, batch_id: str) -> None:
        """Before a batch's first line: no results yet (a validation cut short left none worth keeping)."""
        for suffix in (".out.jsonl", ".err.jsonl"):
            self.path(batch_id, suffix).write_bytes(b"")

    def append(self, batch_id: str, error: bool, line: dict[str, Any]) -> None:
        with self.path(batch_id, ".err.jsonl" if error else ".out.jsonl").open("ab") as f:
            f.write(json.dumps(line).encode() + b"\n")
            f.flush()
            os.fsync(f.fileno())

    def answered(self, batch_id: str) -> tuple[set[str], int, int]:
        """The custom_ids of the requests answered so far, and the counts of completed and failed lines; a torn
        last line (a crash mid-append) is cut off, so that its request runs again."""
        done: set[str] = set()
        counts = [0, 0]
        for index, suffix in enumerate((".out.jsonl", ".err.jsonl")):
            path = self.path(batch_id, suffix)
            data = path.read_bytes() if path.exists() else b""
            if data and not data.endswith(b"\n"):
                data = data[: data.rfind(b"\n") + 1]
                path.write_bytes(data)
            for raw in data.splitlines():
                record = json.loads(raw)
                if record.get("response") is not None:  # a bad line's custom_id may be a good line's too
                    done.add(record.get("custom_id"))
                counts[index] += 1
        return done, counts[0], counts[1]


def _missing(batch_id: str) -> APIError:
    return APIError(f"No such Batch object: {batch_id}", status=404, param="batch_id")
