"""bench/step_threads.py runs end to end on a small checkpoint and prints one line per core and measurement."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_the_bench_prints_both_cores_for_prefill_and_each_batch(qwen2_ckpt: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.step_threads",
            "--model",
            str(qwen2_ckpt),
            "--dtype",
            "float32",
            "--prefill",
            "2x8",
            "--batch",
            "1",
            "3",
            "--rounds",
            "1",
            "--steps",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        # huge pages off: their faults cost ~10 s of system time on this tiny checkpoint, and the re-exec that sets
        # them is tests/engine/test_hugepages.py's
        env={**os.environ, "GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"},
    ).stdout.splitlines()
    assert [line.split(":")[0] for line in out] == [
        "prefill 2x8 round 0 one thread",
        "prefill 2x8 round 0 all threads",
        "decode batch 1 round 0 one thread",
        "decode batch 1 round 0 all threads",
        "decode batch 3 round 0 one thread",
        "decode batch 3 round 0 all threads",
    ], out
    assert all(" ms wall, " in line for line in out[2:]) and "1 step(s)" in out[0]
