"""The kernels run in Triton's interpreter whatever was collected before them.

tests/engine/test_model.py imports transformers, which imports triton (through torch._dynamo) before this folder's
conftest is loaded; triton's own @jit helpers (tl.sum) are then compiled-only unless tests/conftest.py set
TRITON_INTERPRET=1 first, and every kernel calling them fails ("outside of the scope of a kernel").
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_kernels_interpret_after_a_module_that_imports_triton() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # as a plain `python -m pytest` starts
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/engine"]
        + ["-o", "python_files=test_model.py test_dispatch.py", "-k", "test_drop_in_for_the_model_torch_path"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]
