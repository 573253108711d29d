"""`python -m mypy --strict server engine` is clean (pyproject.toml's [tool.mypy] holds the rest of the settings)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_mypy_strict_is_clean() -> None:
    pytest.importorskip("mypy")
    # the repo's .mypy_cache (git-ignored): a cold check takes ~30 s of CPU, a warm one a second or two
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--cache-dir",
            str(REPO / ".mypy_cache"),
            "server",
            "engine",
            "demo",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
