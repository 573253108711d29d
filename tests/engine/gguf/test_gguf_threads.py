"""Several threads deriving GGUF models at once in a fresh process (--models-dir loads models from worker threads):
every derivation succeeds, though transformers' lazy top-level module breaks when two threads import from it first."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.engine.gguf.files import write_llama

THREADS = 8
# The first import of transformers must happen in the threads: a fresh interpreter, transformers not yet imported.
SCRIPT = """
import sys, threading
from pathlib import Path
from engine.gguf.folder import resolve_gguf
assert "transformers" not in sys.modules
files = [Path(p) for p in sys.argv[1:]]
barrier, errors = threading.Barrier(len(files)), []
def derive(path):
    barrier.wait()
    try:
        resolve_gguf(path)
    except Exception as e:
        errors.append(f"{type(e).__name__}: {e}")
threads = [threading.Thread(target=derive, args=(p,)) for p in files]
for t in threads:
    t.start()
for t in threads:
    t.join()
print("\\n".join(errors))
sys.exit(1 if errors else 0)
"""


def test_concurrent_first_derivations_all_succeed(tmp_path: Path) -> None:
    files = [tmp_path / f"model-{i}.gguf" for i in range(THREADS)]
    for i, path in enumerate(files):
        write_llama(path, seed=i)
    env = {**os.environ, "SPINDLE_CACHE_DIR": str(tmp_path / "cache")}
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, *map(str, files)], capture_output=True, text=True, env=env, timeout=300
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert len(list((tmp_path / "cache" / "gguf").glob("model-*"))) == THREADS
