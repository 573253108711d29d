"""The adapter set shared by the API processes of one launcher (--api-server-count above 1): a JSON file in the
launcher's private directory, rewritten whole under an flock by the process whose route changed the set, and
read again by every process whose `stat` sees it changed (one stat per lookup; no event-loop wait: the file
is small and on the same machine)."""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

Entries = dict[str, dict[str, Any]]  # adapter name -> its fields (server/lora/adapters.py Adapter)


class SharedAdapters:
    def __init__(self, folder: str) -> None:
        self.path = Path(folder) / "lora_adapters.json"
        self._lock = Path(folder) / "lora_adapters.lock"
        self._seen: tuple[int, int] | None = None  # (mtime_ns, inode) of the version last read

    def _stamp(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return st.st_mtime_ns, st.st_ino

    def changed(self) -> Entries | None:
        """The shared set when another process rewrote it since this one last read or wrote it, else None."""
        stamp = self._stamp()
        if stamp is None or stamp == self._seen:
            return None
        entries: Entries = json.loads(self.path.read_text())
        self._seen = stamp
        return entries

    def update(self, current: Entries, change: Callable[[Entries], None]) -> Entries:
        """Apply `change` to the shared set (this process's `current` when none was written yet) under the lock;
        the result, written atomically (blocking: call it off the event loop)."""
        with self._lock.open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            entries = json.loads(self.path.read_text()) if self.path.exists() else dict(current)
            change(entries)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(entries))
            os.replace(tmp, self.path)
            self._seen = self._stamp()
        return entries
