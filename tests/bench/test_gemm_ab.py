"""bench/gemm_ab.py's --step mode runs a decode step's products of a checkpoint's shape with two libraries."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from engine.cpu_kernels import build, gemm

pytestmark = pytest.mark.skipif(not gemm.available(), reason="no AVX512-BF16 CPU kernel here (CPU or compiler)")


def test_a_step_of_the_checkpoints_shape_is_timed_part_by_part_for_both_libraries(qwen2_ckpt: Path) -> None:
    lib = build.load(build.FLAGS, build.NEEDS)
    assert lib is not None
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.gemm_ab",
            str(lib._name),
            "--step",
            str(qwen2_ckpt),
            "--rows",
            "1",
            "3",
            "--rounds",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout.splitlines()
    assert len(out) == 8, out
    part = r"qkv [\d.]+, o [\d.]+, gate_up [\d.]+, down [\d.]+, lm_head [\d.]+"
    for i, rows in ((0, 1), (4, 3)):
        assert out[i].startswith(f"{rows} rows, ") and out[i].endswith(f"of {qwen2_ckpt}:"), out[i]
        assert re.fullmatch(rf"\s+this step [\d.]+ ms \({part}\)", out[i + 1]), out[i + 1]
        assert re.fullmatch(rf"\s+other step [\d.]+ ms \({part}\)", out[i + 2]), out[i + 2]
        assert re.fullmatch(r"\s+this / other \d+\.\d{3}", out[i + 3]), out[i + 3]
