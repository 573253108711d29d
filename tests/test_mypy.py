"""`python -m mypy --strict server engine` is clean (pyproject.toml's [tool.mypy] holds the rest of the settings)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine.cache_root import cache_root

REPO = Path(__file__).resolve().parents[1]


def test_mypy_strict_is_clean() -> None:
    pytest.importorskip("mypy")
    # in the spindle cache, not the checkout: a fresh clone reuses it (mypy checks each file's hash), so only a
    # machine's first check is cold (~45 s of CPU, two thirds of it transformers' and torch's stubs)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--cache-dir",
            str(cache_root() / "mypy"),
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
