"""Processes from the outside: a server's process tree, whether a pid has exited, waits that fail when they time out."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def process_tree(pid: int) -> list[int]:
    """Every descendant of `pid` (not `pid` itself)."""
    found = []
    for child in children(pid):
        found += [child, *process_tree(child)]
    return found


def alive(pid: int) -> bool:
    """True while `pid` runs; a zombie has exited (only its parent has not reaped it yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(") ", 1)[1][0] != "Z"  # the state follows the command name, which may hold ") "


def wait_until(condition: Callable[[], bool], timeout: float, what: str | Callable[[], str],
               interval: float = 0.05) -> None:
    """Poll `condition` (another process's state: nothing to wait on) until true; after `timeout` seconds fail,
    saying `what` did not happen (a callable: worded at that moment)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {timeout} s: {what() if callable(what) else what}")
        time.sleep(interval)


def wait_gone(pids: int | Iterable[int], timeout: float) -> None:
    """Every process in `pids` exits within `timeout` seconds, else the test fails naming those still running."""
    pids = [pids] if isinstance(pids, int) else list(pids)
    wait_until(lambda: not any(alive(p) for p in pids), timeout,
               lambda: f"processes {pids} exited ({[p for p in pids if alive(p)]} still run)")
