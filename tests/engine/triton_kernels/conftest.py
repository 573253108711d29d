"""Run the Triton kernels on CPU tensors through Triton's interpreter.

TRITON_INTERPRET is read when @triton.jit decorates, i.e. when a kernel module is imported, so it is set
here, before any test module imports one.
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

_early = [
    m
    for m in (
        "rmsnorm",
        "rotary",
        "kv_cache_write",
        "paged_decode_attention",
        "paged_prefill_attention",
        "token_bitmask",
        "fused_moe",
        "lora",
    )
    if f"engine.triton_kernels.{m}" in sys.modules
]
if _early:
    raise RuntimeError(
        f"engine.triton_kernels modules {_early} were imported before TRITON_INTERPRET=1 was set; "
        "import them lazily (through engine.triton_kernels' functions) outside the kernel tests"
    )

# Tolerances (atol, rtol) per dtype: float32 close to exact; half precisions round inputs and outputs.
TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (3e-2, 3e-2), torch.float16: (5e-3, 5e-3)}


@pytest.fixture
def tol() -> dict[torch.dtype, tuple[float, float]]:
    return TOL


@pytest.fixture(autouse=True)
def _seeded() -> None:
    torch.manual_seed(0)  # one thread: tests/engine/conftest.py
