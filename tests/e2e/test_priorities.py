"""The engine and the render workers run nicer than the API server (engine/__main__.py run_below_server,
server/render/render_worker.py main), every thread of them, so the server's event loop gets a core first.

The mechanism only, read from /proc/<pid>/task/<tid>/stat; the latency it buys is bench.responsiveness's.
"""

from __future__ import annotations

import os
import time

import httpx

from engine.__main__ import NICE_BELOW_SERVER
from server.render import child
from tests.e2e.conftest import Server

SCHED_OTHER = 0


def _stat(pid: int, tid: int) -> list[str]:
    """Fields 3 on of /proc/<pid>/task/<tid>/stat (the comm may hold spaces and parentheses)."""
    with open(f"/proc/{pid}/task/{tid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def _threads(pid: int) -> dict[int, tuple[int, int]]:
    """tid -> (nice, scheduling policy) for every thread of pid."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = _stat(pid, int(tid))
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        out[int(tid)] = (int(fields[16]), int(fields[38]))  # proc(5): field 19 nice, field 41 policy
    return out


def _children(pid: int) -> dict[int, bytes]:
    """pid -> command line of each child of pid."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    out[int(entry)] = f.read()
        except (FileNotFoundError, ProcessLookupError):
            continue
    return out


def test_engine_and_workers_run_nicer_than_the_server(server: Server) -> None:
    assert child.NICE_BELOW_SERVER == NICE_BELOW_SERVER
    # a step (the LM head's helper threads start with the first one) and a worker tokenization (> 512 chars)
    r = httpx.post(
        f"{server.url}/v1/completions",
        timeout=60,
        json={"model": "tiny", "prompt": "hello", "max_tokens": 2, "ignore_eos": True},
    )
    assert r.status_code == 200, r.text
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": "word " * 400}, timeout=60)
    assert r.status_code == 200, r.text

    api = _threads(server.proc.pid)
    base = api[server.proc.pid][0]
    assert base == os.getpriority(os.PRIO_PROCESS, 0)  # the server itself keeps the priority it was started with
    assert {policy for _, policy in api.values()} == {SCHED_OTHER}
    want = min(base + NICE_BELOW_SERVER, 19)

    deadline = time.monotonic() + 10  # a worker another test killed may be starting: look again
    while True:
        kids = _children(server.proc.pid)
        engines = [p for p, cmd in kids.items() if b"\0-m\0engine\0" in cmd]
        workers = [p for p, cmd in kids.items() if b"server.render.render_worker" in cmd]
        seen = {p: _threads(p) for p in engines + workers}
        ok = (
            len(engines) == 1
            and workers
            and all(prio == (want, SCHED_OTHER) for threads in seen.values() for prio in threads.values())
        )
        if ok or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(engines) == 1, kids
    assert workers, kids
    assert len(seen[engines[0]]) > 2, "expected the engine's step, watchdog, heartbeat and LM-head threads"
    for pid, threads in seen.items():
        assert all(prio == (want, SCHED_OTHER) for prio in threads.values()), (pid, kids[pid][:40], threads)
