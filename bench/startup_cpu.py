"""CPU seconds of a server start on the tiny Qwen2 test checkpoint, as each end-to-end test's start costs.

    python -m bench.startup_cpu [--runs 3]

Per run: the API process's, the engine's and the render worker's CPU (user + sys, from /proc) when /health
first answers 200, and the whole process tree's once the server has exited (getrusage of the reaped children:
start, the polls and the shutdown). Prints the per-run figures, then the minimum and median of each.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.serve import cpu_seconds
from tests.e2e.conftest import start_server


def _tree(pid: int) -> list[int]:
    """`pid` and its descendants (from /proc/PID/task/*/children)."""
    found = [pid]
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            found += _tree(int(child))
    return found


def _role(pid: int) -> str:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    module = argv[2].decode() if len(argv) > 2 and argv[1] == b"-m" else argv[0].decode()
    return {"server": "api", "engine": "engine", "server.render.render_worker": "render"}.get(module, module)


def one_start(ckpt: Path, tmp: Path) -> dict[str, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    server = start_server(ckpt, tmp)
    figures = {"ready_s": time.monotonic() - started}
    for pid in _tree(server.proc.pid):
        role = _role(pid)
        figures[role] = figures.get(role, 0.0) + cpu_seconds(pid)
    server.stop()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    figures["tree"] = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    from tests.conftest import build_checkpoint  # why here: torch, for the checkpoint only

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = build_checkpoint(Path(tmp), "qwen2")
        runs = [one_start(ckpt, Path(tmp)) for _ in range(args.runs)]
    for i, run in enumerate(runs):
        print(f"run {i}: " + ", ".join(f"{k} {v:.2f}" for k, v in run.items()))
    for key in runs[0]:
        values = [r.get(key, 0.0) for r in runs]
        print(f"{key}: min {min(values):.2f} s, median {statistics.median(values):.2f} s")
    print(f"CPU: {os.cpu_count()} cores; {sys.version.split()[0]}")


if __name__ == "__main__":
    main()
