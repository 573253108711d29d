"""Decode attention over the paged cache in bfloat16 through decode_attention.cpp (one query token per sequence).

`attend(q, k_cache, v_cache, tables, lens, los, scale, softcap)`: the sequences' keys are read in place, block by
block; scores, softmax and the weighted sum of values are float32, the output rounded once to bfloat16.
`usable(...)` is False where it cannot run (engine/cpu_kernels); callers then keep engine/layers/cpu_attention.py's
path.
"""

from __future__ import annotations

import ctypes
import functools
import math
from typing import Any

import torch

from engine.cpu_kernels.build import kernel

ABI = 2
MAX_HEAD_DIM = 256
_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
_ARGS = [_P, _L, _L, _I, _I, _I, _I, _P, _P, _L, _L, _L, _I, _P, _L, _P, _P, _F, _F, _P, _L, _L, _I]


@functools.cache
def _kernel() -> Any:
    return kernel("decode_attention", ABI, _ARGS, check=_self_check)


def _self_check(fn: Any) -> str | None:
    """Two sequences (one with a window) against the softmax written out in float64."""
    g = torch.Generator().manual_seed(0)
    blocks, bs, kvh, d, heads = 6, 4, 2, 32, 4
    k = torch.randn(blocks, bs, kvh, d, generator=g).bfloat16()
    v = torch.randn(blocks, bs, kvh, d, generator=g).bfloat16()
    q = torch.randn(2, heads, d, generator=g).bfloat16()
    tables = torch.tensor([[3, 1, 5], [0, 2, 4]], dtype=torch.int32)
    lens, los = torch.tensor([9, 12], dtype=torch.int32), torch.tensor([0, 5], dtype=torch.int32)
    got = _call(fn, q, k, v, tables, lens, los, 0.125, None, 2)
    for b in range(2):
        rows = torch.cat([torch.arange(int(t) * bs, int(t) * bs + bs) for t in tables[b]])[int(los[b]) : int(lens[b])]
        kk, vv = k.flatten(0, 1)[rows].double(), v.flatten(0, 1)[rows].double()  # [keys, kvh, d]
        for h in range(heads):
            p = torch.softmax(kk[:, h // 2] @ q[b, h].double() * 0.125, dim=0)
            want = p @ vv[:, h // 2]
            if not torch.allclose(got[b, h].double(), want, rtol=2e-2, atol=2e-2):
                return f"its self-check is off by {(got[b, h].double() - want).abs().max().item():.3g}"
    return None


def usable(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """q [B, heads, D] and a cache [num_blocks, block_size, kv_heads, D], both bfloat16 on CPU."""
    d = q.shape[-1]
    return (
        q.device.type == "cpu"
        and q.dtype == torch.bfloat16
        and k_cache.dtype == torch.bfloat16
        and d % 32 == 0
        and d <= MAX_HEAD_DIM
        and q.shape[1] % k_cache.shape[2] == 0
        and q.stride(-1) == 1
        and k_cache.stride(-1) == 1
        and _kernel() is not None
    )


def attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    los: torch.Tensor,
    scale: float,
    softcap: float | None = None,
    threads: int | None = None,
) -> torch.Tensor:
    """q [B, heads, D]; caches [num_blocks, block_size, kv_heads, D] (any strides, D contiguous; K and V alike);
    tables int32 [B, W]: each sequence's blocks from position 0; sequence b attends keys [los[b], lens[b]).
    -> [B, heads, D] bfloat16."""
    fn = _kernel()
    if fn is None:
        raise RuntimeError("the decode_attention CPU kernel is not available here (see usable())")
    return _call(fn, q, k_cache, v_cache, tables, lens, los, scale, softcap, threads or torch.get_num_threads())


def _call(
    fn: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    los: torch.Tensor,
    scale: float,
    softcap: float | None,
    threads: int,
) -> torch.Tensor:
    b, heads, d = q.shape
    if k.stride() != v.stride() or k.shape != v.shape:
        raise ValueError("K and V caches must share one shape and layout")
    if tables.dtype != torch.int32 or lens.dtype != torch.int32 or los.dtype != torch.int32 or tables.stride(-1) != 1:
        raise ValueError("tables, lens and los must be int32 (tables with contiguous rows)")
    if softcap is not None and not (math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be a positive number, got {softcap}")
    out = torch.empty(b, heads, d, dtype=torch.bfloat16)
    if b == 0:
        return out
    lens, los = lens.contiguous(), los.contiguous()
    fn(
        q.data_ptr(),
        q.stride(0),
        q.stride(1),
        b,
        heads,
        k.shape[2],
        d,
        k.data_ptr(),
        v.data_ptr(),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        k.shape[1],
        tables.data_ptr(),
        tables.stride(0),
        lens.data_ptr(),
        los.data_ptr(),
        scale,
        softcap or 0.0,
        out.data_ptr(),
        out.stride(0),
        out.stride(1),
        threads,
    )
    return out
