"""Processes from the outside: a server's process tree, whether a pid has exited, waits that fail when they time out."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path


def children(pid: int, command: str | None = None) -> list[int]:
    """The children of `pid` (those whose command line matches the regex `command`, if given)."""
    pattern = ["-f", command] if command is not None else []
    out = subprocess.run(["pgrep", "-P", str(pid), *pattern], capture_output=True, text=True)
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


def wait_until(
    condition: Callable[[], bool], timeout: float, what: str | Callable[[], str], interval: float = 0.05
) -> None:
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
    wait_until(
        lambda: not any(alive(p) for p in pids),
        timeout,
        lambda: f"processes {pids} exited ({[p for p in pids if alive(p)]} still run)",
    )


def _tcp_inode(local_port: int, remote_port: int) -> int | None:
    """The inode of the 127.0.0.1 TCP socket bound to `local_port` and connected to `remote_port` (/proc/net/tcp)."""
    want = (f"0100007F:{local_port:04X}", f"0100007F:{remote_port:04X}")
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if (fields[1], fields[2]) == want:
            return int(fields[9])
    return None


def connection_owner(server_port: int, client_port: int, pids: Iterable[int]) -> int | None:
    """Which of `pids` holds the server side of the open connection from `client_port` (the process that
    accepted it); None if none does."""
    inode = _tcp_inode(server_port, client_port)
    if inode is None:
        return None
    link = f"socket:[{inode}]"
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except FileNotFoundError:  # the process has exited
            continue
        for fd in fds:
            try:
                if os.readlink(fd) == link:
                    return pid
            except FileNotFoundError:  # closed since the listing
                continue
    return None
