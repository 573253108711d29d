"""A derivation killed midway leaves its `.derive-*` folder in the cache; the next start removes it, and never one a
live process is still writing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.gguf.folder import resolve_gguf
from tests.engine.gguf.files import write_llama

# Derives `argv[1]` with the writing replaced: "kill" dies by SIGKILL inside it, "block" says so and waits on stdin.
SCRIPT = """
import os, signal, sys
from pathlib import Path

import pytest
from engine.gguf import folder

def write(model, out):
    if sys.argv[2] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    print(out, flush=True)
    sys.stdin.readline()

folder._write = write
folder.resolve_gguf(Path(sys.argv[1]))
"""


def _derive(path: Path, how: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(path), how],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


def test_a_killed_derivations_folder_is_removed_and_a_live_ones_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("SPINDLE_CACHE_DIR", str(cache))
    env = {**os.environ, "SPINDLE_CACHE_DIR": str(cache)}
    killed, live, served = (tmp_path / f"{name}.gguf" for name in ("killed", "live", "served"))
    for path in (killed, live, served):
        write_llama(path)
    assert _derive(killed, "kill", env).wait(120) == -9
    left = list((cache / "gguf").glob(".derive-*"))
    assert len(left) == 1 and not any(left[0].iterdir())
    writing = _derive(live, "block", env)
    try:
        assert writing.stdout is not None
        live_tmp = Path(writing.stdout.readline().strip())  # the live derivation's folder, created and in use
        assert live_tmp.is_dir()
        resolve_gguf(served)  # the next start
        assert not left[0].exists()
        assert live_tmp.is_dir()
    finally:
        writing.kill()
        writing.wait()
