"""The interpreter runs kernels as numpy and accepts code a GPU compiler rejects (tl.dot shapes, types,
scalar control flow); compiling for sm_90 with Triton's bundled ptxas catches that here, GPU or not."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_kernels_compile_for_hopper() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "engine.triton_kernels.compile_check", "--quick", "--arch", "90"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("ok ") == 13, (
        proc.stdout
    )  # every kernel and variant in variants(quick=True), LoRA shrink/expand at ranks 16 and 64 included
