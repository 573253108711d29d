"""The greedy sampler's argmax over float32 logits on CPU, through argmax.cpp: one AVX-512 pass giving
torch.argmax's answer (each row's first maximal column). `argmax(x)` is None where the kernel does not run here
or a row holds a NaN or +inf or no finite value: the sampler's careful path then decides (engine/execution/sampler.py).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

from engine.cpu_kernels.build import kernel

ABI = 1
_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int


@functools.cache
def _kernel() -> Any:
    return kernel("argmax", ABI, [_P, _L, _I, _L, _P, _I], check=_self_check, restype=_I)


def _self_check(fn: Any) -> str | None:
    """A broken build must not pick tokens: ties, a tail past the unrolled loop, a NaN row."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 203, generator=g)
    x[0, 7] = x[0, 190] = 9.0
    x[1, 202] = 9.0
    got, want = _call(fn, x, 1), x.argmax(-1)
    x[2, 5] = float("nan")
    if got is None or not torch.equal(got, want) or _call(fn, x, 1) is not None:
        return "its self-check is off"
    return None


def _call(fn: Any, x: torch.Tensor, threads: int) -> torch.Tensor | None:
    rows, n = x.shape
    out = torch.empty(rows, dtype=torch.int64)
    if fn(x.data_ptr(), x.stride(0), rows, n, out.data_ptr(), max(1, min(threads, rows))):
        return None
    return out


def argmax(x: torch.Tensor, threads: int = 1) -> torch.Tensor | None:
    """x [rows, n] float32 on CPU, unit column stride: x.argmax(-1) (int64), or None where the kernel does not
    run here or a row holds a NaN or +inf or nothing above -inf."""
    if (
        x.device.type != "cpu"
        or x.dtype is not torch.float32
        or x.dim() != 2
        or x.stride(1) != 1
        or not 0 < x.shape[1] < 2**31
        or x.shape[0] == 0
    ):
        return None
    fn = _kernel()
    return None if fn is None else _call(fn, x, threads)
