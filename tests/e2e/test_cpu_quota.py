"""The real server in a real cgroup v1 cpu group with a quota of one CPU: its engine runs one thread."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import Server, free_port, wait_healthy

V1_CPU = Path("/sys/fs/cgroup/cpu")


@pytest.fixture
def one_cpu_cgroup() -> Iterator[Path]:
    """A cgroup v1 cpu group with a quota of one CPU (100 ms per 100 ms period), removed afterwards."""
    if not (V1_CPU / "cpu.cfs_quota_us").exists() or not os.access(V1_CPU, os.W_OK):
        pytest.skip(f"no writable cgroup v1 cpu controller at {V1_CPU} (needs root on a v1 or hybrid host)")
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU in the affinity mask: a quota of one CPU would not change the thread count")
    group = V1_CPU / f"spindle-test-{uuid.uuid4().hex[:8]}"
    try:
        group.mkdir()
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text("100000")
    except OSError as e:
        pytest.skip(f"cannot make a cgroup under {V1_CPU}: {e}")
    yield group
    for pid in (group / "cgroup.procs").read_text().split():  # a straggler back to the root, or rmdir fails
        (V1_CPU / "cgroup.procs").write_text(pid)
    group.rmdir()


def start_in_cgroup(group: Path, model: Path, tmp: Path, *args: str) -> Server:
    """`python -m server` moved into `group` before it runs (its engine, a child, inherits the group)."""
    port = free_port()
    log = tmp / f"server-{port}.log"
    cmd = [sys.executable, "-m", "server", "--model", str(model), "--port", str(port), "--host", "127.0.0.1", *args]
    env = {**os.environ, "SPINDLE_LOG_LEVEL": "INFO", "SPINDLE_STRUCTURED_OUTPUTS_WARMUP": "0"}

    def join() -> None:
        (group / "cgroup.procs").write_text(str(os.getpid()))

    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, preexec_fn=join)
    server = Server(proc, port, log, list(args))
    wait_healthy(server)
    return server


def _threads_line(log: Path) -> str:
    lines = [line for line in log.read_text().splitlines() if "CPU threads:" in line]
    assert len(lines) == 1, log.read_text()[-3000:]
    return lines[0]


def test_an_engine_under_a_one_cpu_quota_runs_one_thread(
    one_cpu_cgroup: Path, qwen2_ckpt: Path, tmp_path: Path
) -> None:
    server = start_in_cgroup(one_cpu_cgroup, qwen2_ckpt, tmp_path)
    try:
        assert str(server.engine_pid()) in (one_cpu_cgroup / "cgroup.procs").read_text().split()
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200, r.text
    finally:
        server.stop()
    line = _threads_line(server.log)
    assert re.search(r"CPU threads: 1 \(from the cgroup CPU quota; .*CPU quota 1 at .*spindle-test-", line), line


def test_the_flag_overrides_the_quota(one_cpu_cgroup: Path, qwen2_ckpt: Path, tmp_path: Path) -> None:
    server = start_in_cgroup(one_cpu_cgroup, qwen2_ckpt, tmp_path, "--cpu-threads", "2")
    server.stop()
    assert "CPU threads: 2 (from --cpu-threads; " in _threads_line(server.log)
