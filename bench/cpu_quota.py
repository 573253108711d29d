"""Decode speed under a container's CPU quota against the same server pinned to that many cores.

    python -m bench.cpu_quota --model PATH [--cpus 1] [--rounds 3] [--output-len 64]

Three arms, alternated within each round (a busy machine slows all alike): the server in a cgroup v1 cpu group
with a quota of --cpus CPUs (the engine fits its threads to the quota: engine/cpu_threads.py), the same quota
with --cpu-threads set to every visible CPU (what torch's default did), and the server pinned by taskset to
--cpus cores in a cgroup of its own with no quota (each arm a group: the scheduler weighs a group as one against
other processes, whatever its tasks' nice; the engine runs 10 nicer than the server). Each arm: one fresh
server, one warm-up request, then one greedy stream of --output-len tokens per round; decode tok/s = (tokens -
1) / (last token - first token). Needs root and a writable /sys/fs/cgroup/cpu (a v1 or hybrid host). The
product target: quota / pinned >= 0.8.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx

from engine.cpu_kernels.chooser import cpu_model

V1_CPU = Path("/sys/fs/cgroup/cpu")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(
    model: str, extra: list[str], wrap: list[str], join: Callable[[], None] | None, log: Path
) -> tuple[subprocess.Popen[bytes], str]:
    port = _port()
    cmd = [*wrap, sys.executable, "-m", "server", "--model", model, "--port", str(port), "--host", "127.0.0.1", *extra]
    env = {**os.environ, "SPINDLE_LOG_LEVEL": "INFO", "SPINDLE_STRUCTURED_OUTPUTS_WARMUP": "0"}
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, preexec_fn=join)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server not healthy in 600 s")


def decode_rate(url: str, output_len: int) -> float:
    """Tokens per second after the first, of one greedy stream."""
    body = {"prompt": "The history of the city", "max_tokens": output_len, "ignore_eos": True, "stream": True}
    stamps: list[float] = []
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "temperature": 0}, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                stamps.append(time.perf_counter())
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def threads_line(log: Path) -> str:
    return next(
        (line.split("engine INFO ", 1)[-1] for line in log.read_text().splitlines() if "CPU threads:" in line), "?"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--cpus", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--output-len", type=int, default=64)
    args = ap.parse_args()
    visible = len(os.sched_getaffinity(0))
    tag = uuid.uuid4().hex[:8]
    group, free = V1_CPU / f"spindle-bench-{tag}", V1_CPU / f"spindle-bench-{tag}-free"
    for g, quota in ((group, 100000 * args.cpus), (free, -1)):
        g.mkdir()
        (g / "cpu.cfs_period_us").write_text("100000")
        (g / "cpu.cfs_quota_us").write_text(str(quota))

    def join() -> None:
        (group / "cgroup.procs").write_text(str(os.getpid()))

    def join_free() -> None:
        (free / "cgroup.procs").write_text(str(os.getpid()))

    cores = ",".join(map(str, sorted(os.sched_getaffinity(0))[: args.cpus]))
    arms: dict[str, tuple[list[str], list[str], Callable[[], None] | None]] = {
        f"quota {args.cpus} CPU": ([], [], join),
        f"quota {args.cpus} CPU, --cpu-threads {visible}": (["--cpu-threads", str(visible)], [], join),
        f"taskset {cores}": ([], ["taskset", "-c", cores], join_free),
    }
    rates: dict[str, list[float]] = {arm: [] for arm in arms}
    lines: dict[str, str] = {}
    logs = Path(f"/tmp/spindle-bench-quota-{os.getpid()}")
    logs.mkdir(exist_ok=True)
    try:
        for rnd in range(args.rounds):
            for arm, (extra, wrap, joiner) in arms.items():
                log = logs / f"{len(lines)}-{rnd}.log"
                proc, url = start(args.model, extra, wrap, joiner, log)
                try:
                    decode_rate(url, 8)  # warm-up: first-use kernel choices, caches
                    rates[arm].append(decode_rate(url, args.output_len))
                finally:
                    proc.send_signal(signal.SIGINT)
                    proc.wait(60)
                lines[arm] = threads_line(log)
                print(f"round {rnd} {arm}: {rates[arm][-1]:.2f} tok/s", flush=True)
    finally:
        for g in (group, free):
            for pid in (g / "cgroup.procs").read_text().split():
                (V1_CPU / "cgroup.procs").write_text(pid)
            g.rmdir()
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"model {args.model}, {visible} visible CPUs, {cpu_model()}, load average {load}")
    base = statistics.median(rates[f"taskset {cores}"])
    for arm, got in rates.items():
        med = statistics.median(got)
        print(f"{arm:40s} median {med:6.2f} tok/s  {med / base:.2f}x pinned   [{lines[arm]}]")


if __name__ == "__main__":
    main()
