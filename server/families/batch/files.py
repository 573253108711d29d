"""The files of /v1/files on disk: <batch dir>/files/<id>.data and its object, <id>.json. Uploads (purpose
"batch") and a batch's results (purpose "batch_output") alike. Blocking: callers run it in a thread."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from server.families.batch.disk import new_id, newest_first, page, read_json, write_atomic, write_json
from server.http.errors import APIError

PURPOSES = ("batch", "batch_output")


class FileStore:
    def __init__(self, root: Path) -> None:
        self.dir = root / "files"

    def _paths(self, file_id: str) -> tuple[Path, Path]:
        if not file_id or "/" in file_id or file_id.startswith("."):
            raise _missing(file_id)
        return self.dir / f"{file_id}.json", self.dir / f"{file_id}.data"

    def _object(self, file_id: str, size: int, filename: str, purpose: str) -> dict[str, Any]:
        return {
            "id": file_id,
            "object": "file",
            "bytes": size,
            "created_at": int(time.time()),
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
            "status_details": None,
            "expires_at": None,
        }

    def save(self, data: bytes, filename: str, purpose: str) -> dict[str, Any]:
        self.dir.mkdir(parents=True, exist_ok=True)
        file_id = new_id("file-")
        meta, content = self._paths(file_id)
        write_atomic(content, data)
        obj = self._object(file_id, len(data), filename, purpose)
        write_json(meta, obj)  # the object last: a file without one was never listed
        return obj

    def adopt(self, source: Path, filename: str, purpose: str) -> dict[str, Any]:
        """A finished result file moved in as a new file (same folder tree: a rename)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        file_id = new_id("file-")
        meta, content = self._paths(file_id)
        os.replace(source, content)
        obj = self._object(file_id, content.stat().st_size, filename, purpose)
        write_json(meta, obj)
        return obj

    def get(self, file_id: str) -> dict[str, Any]:
        meta, _content = self._paths(file_id)
        obj = read_json(meta)
        if obj is None:
            raise _missing(file_id)
        return obj

    def content(self, file_id: str) -> Path:
        self.get(file_id)
        return self._paths(file_id)[1]

    def read(self, file_id: str) -> bytes:
        return self.content(file_id).read_bytes()

    def delete(self, file_id: str) -> dict[str, Any]:
        meta, content = self._paths(file_id)
        if read_json(meta) is None:
            raise _missing(file_id)
        meta.unlink(missing_ok=True)
        content.unlink(missing_ok=True)
        return {"id": file_id, "object": "file", "deleted": True}

    def listing(self, purpose: str | None, after: str | None, limit: int, ascending: bool) -> dict[str, Any]:
        objs = (
            [obj for path in self.dir.glob("*.json") if (obj := read_json(path)) is not None]
            if self.dir.is_dir()
            else []
        )
        if purpose is not None:
            objs = [obj for obj in objs if obj.get("purpose") == purpose]
        ordered = newest_first(objs)
        return page(ordered[::-1] if ascending else ordered, after, limit)


def _missing(file_id: str) -> APIError:
    return APIError(f"No such File object: {file_id}", status=404, param="file_id")
