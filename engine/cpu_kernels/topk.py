"""The top-k sampler's candidates over float32 logits on CPU, through topk.cpp: one AVX-512 pass with a running
threshold instead of torch.topk's partial sort. `topk(x, k)` is None where the kernel does not run here or a row
has fewer than k values above -inf: the sampler then calls torch.topk (engine/execution/sampler.py).
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
    return kernel("topk", ABI, [_P, _L, _I, _L, _I, _P, _P, _I], check=_self_check, restype=_I)


def _self_check(fn: Any) -> str | None:
    """A broken build must not pick candidates: ties at the k-th place, a tail past 16 columns, enough passes to
    cut the buffer, a row with too few finite values."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 1003, generator=g)
    x[0, 7] = x[0, 190] = x[0, 1000] = 9.0
    x[1, 1002] = 9.0
    x[2] = torch.arange(1003, dtype=torch.float32)  # rising: every column passes, the buffer is cut many times
    for k in (1, 2, 40):
        got = _call(fn, x, k, 1)
        want = x.topk(k, dim=-1)
        if got is None or not torch.equal(got[0], want.values) or not _same_ties(x, got[1], want.values):
            return "its self-check is off"
    x[1, 3:] = -torch.inf
    return None if _call(fn, x, 4, 1) is None else "its self-check is off"


def _same_ties(x: torch.Tensor, idx: torch.Tensor, values: torch.Tensor) -> bool:
    """Each column holds the value reported, and equal values come in rising column order."""
    if not torch.equal(x.gather(1, idx), values):
        return False
    same = values[:, 1:] == values[:, :-1]
    return bool((idx[:, 1:][same] > idx[:, :-1][same]).all())


def _call(fn: Any, x: torch.Tensor, k: int, threads: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    rows, n = x.shape
    vals = torch.empty(rows, k, dtype=torch.float32)
    idx = torch.empty(rows, k, dtype=torch.int64)
    if fn(x.data_ptr(), x.stride(0), rows, n, k, vals.data_ptr(), idx.data_ptr(), max(1, min(threads, rows))):
        return None
    return vals, idx


def topk(x: torch.Tensor, k: int, threads: int = 1) -> tuple[torch.Tensor, torch.Tensor] | None:
    """x [rows, n] float32 on CPU, unit column stride, no NaN or +inf: x.topk(k, dim=-1) as (values, int64
    indices), equal values in rising column order; None where the kernel does not run here or a row has fewer
    than k values above -inf."""
    if (
        x.device.type != "cpu"
        or x.dtype is not torch.float32
        or x.dim() != 2
        or x.stride(1) != 1
        or not 0 < k <= x.shape[1] < 2**31
        or x.shape[0] == 0
    ):
        return None
    fn = _kernel()
    return None if fn is None else _call(fn, x, k, threads)
