"""bench/decode_attention.py runs end to end: every variant checked against the reference, then timed, with the
engine's calls rotating over copies of the caches (--cold) on two threads."""

from __future__ import annotations

import subprocess
import sys


def test_the_bench_checks_and_times_every_variant_with_cold_caches() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.decode_attention",
            "--batch",
            "3",
            "--ctx",
            "40",
            "--dtype",
            "bfloat16",
            "float32",
            "--threads",
            "2",
            "--cold",
            "3",
            "--rounds",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout.splitlines()
    assert "threads 2" in out[0]
    rows = [line.split() for line in out[2:]]
    assert [r[:3] for r in rows] == [["bfloat16", "3", "40"], ["float32", "3", "40"]], out
    assert all(r[-1] == "1.0x)" and float(r[-3]) > 0 for r in rows), out  # the engine's column, last
