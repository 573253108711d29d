"""Run the Triton kernels on CPU tensors through Triton's interpreter.

TRITON_INTERPRET is read when @triton.jit decorates: a kernel module's kernels when it is imported, triton's own
helpers (tl.sum, tl.cdiv) when triton is. tests/conftest.py sets it before any test module is imported; this
conftest only checks that nothing was decorated before.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("TRITON_INTERPRET=1 must be set before triton is imported: tests/conftest.py sets it")


def compiled_only(modules: dict[str, object]) -> list[str]:
    """@triton.jit functions decorated while TRITON_INTERPRET was off: the interpreter cannot call them."""
    from triton.runtime.jit import JITFunction

    return sorted(f"{n}.{a}" for n, m in modules.items() for a, v in vars(m).items() if isinstance(v, JITFunction))


if "triton" in sys.modules:
    _stale = compiled_only(
        {n: m for n, m in list(sys.modules.items()) if n.startswith(("triton.language", "engine.triton_kernels."))}
    )
    if _stale:
        raise RuntimeError(
            f"imported before TRITON_INTERPRET=1 was set, so compiled-only (the interpreter fails calling them): "
            f"{_stale[:5]}; set it before anything imports triton, as tests/conftest.py does"
        )

# Tolerances (atol, rtol) per dtype: float32 close to exact; half precisions round inputs and outputs.
TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (3e-2, 3e-2), torch.float16: (5e-3, 5e-3)}


@pytest.fixture
def tol() -> dict[torch.dtype, tuple[float, float]]:
    return TOL


@pytest.fixture(autouse=True)
def _seeded() -> None:
    torch.manual_seed(0)  # one thread: tests/engine/conftest.py
