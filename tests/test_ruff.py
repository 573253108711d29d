"""ruff's lint and format are clean over the tree (pyproject.toml's [tool.ruff] holds the settings)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _ruff(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=REPO, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args", [("check", "."), ("format", "--check", ".")], ids=["lint", "format"])
def test_ruff_is_clean(args: tuple[str, ...]) -> None:
    proc = _ruff(*args)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_ruff_sees_a_fault(tmp_path: Path) -> None:
    """The check can fail: an unused import in a file under the same settings is reported."""
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n")
    proc = _ruff("check", "--config", str(REPO / "pyproject.toml"), str(bad))
    assert proc.returncode == 1 and "F401" in proc.stdout
