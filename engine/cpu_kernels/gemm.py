"""y = x @ W.T + b in bfloat16 on CPU through gemm_bf16.cpp: `w = PackedWeight(weight, bias); y = w(x, threads)`.

The weight is packed once at load (gemm_bf16.cpp says how and why); results round as torch's bf16 `linear`
does (float32 sums, one rounding). `available()` is False where the kernel cannot run (engine/cpu_kernels).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

from engine.cpu_kernels.build import kernel

ABI = 2
BLOCK = 16  # output columns per packed block
_P = ctypes.c_void_p
_ARGS = [_P, ctypes.c_long, ctypes.c_int, ctypes.c_int, _P, ctypes.c_int, _P, _P, ctypes.c_long, _P, ctypes.c_long,
         ctypes.c_int]


@functools.cache
def _kernel() -> Any:
    return kernel("gemm_bf16", ABI, _ARGS, check=_self_check)


def _self_check(fn: Any) -> str | None:
    """A broken build (a compiler that miscompiles, a CPU that lies about a flag) must not reach a model."""
    g = torch.Generator().manual_seed(0)
    for m, n, k in ((1, 40, 64), (5, 17, 96), (19, 33, 64)):
        w = torch.randn(n, k, generator=g).bfloat16()
        x = torch.randn(m, k, generator=g).bfloat16()
        ref = x.double() @ w.double().t()
        got = _call(fn, x, pack(w), n, None, torch.empty(m, n, dtype=torch.bfloat16), 2)
        if not torch.allclose(got.double(), ref, rtol=1e-2, atol=1e-2):
            return f"its self-check at {m}x{k} @ {k}x{n} is off by {(got.double() - ref).abs().max().item():.3g}"
    return None


def available() -> bool:
    return _kernel() is not None


def usable(weight: torch.Tensor) -> bool:
    """Whether this weight [out, in] can go through the kernel: bfloat16 on CPU, `in` even, kernel available."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and weight.shape[1] % 2 == 0 and available())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] bf16 -> [ceil(N/16), K/2, 16, 2]: blocks of 16 output columns, a pair of k per 64 bytes."""
    n, k = weight.shape
    rows = -(-n // BLOCK) * BLOCK
    padded = weight.new_zeros(rows, k)
    padded[:n] = weight
    return padded.view(rows // BLOCK, BLOCK, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The [N, K] weight back from pack()."""
    blocks, pairs = packed.shape[0], packed.shape[1]
    return packed.permute(0, 2, 1, 3).reshape(blocks * BLOCK, pairs * 2)[:n].contiguous()


class PackedWeight:
    """A weight [N, K] (and bias [N]) packed once, checked once; `w(x, threads)` is the per-step call, kept lean:
    a decode step makes about a hundred of them."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        if not usable(weight):
            raise ValueError("PackedWeight takes a bfloat16 CPU weight [N, even K] where the kernel runs")
        self.n, self.k = int(weight.shape[0]), int(weight.shape[1])
        if bias is not None and (bias.dtype != torch.bfloat16 or bias.numel() != self.n):
            raise ValueError(f"bias must be bfloat16 [{self.n}]")
        self.packed = pack(weight)
        self.bias = None if bias is None else bias.contiguous()
        self._w, self._b = self.packed.data_ptr(), None if self.bias is None else self.bias.data_ptr()
        self._fn = _kernel()

    def __call__(self, x: torch.Tensor, threads: int = 1, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] bf16 -> [..., N] bf16, or into `out` [M, N] (bf16, or float32: the bf16 product widened)."""
        k, n = self.k, self.n
        x2 = x if x.dim() == 2 else x.reshape(-1, k)
        if x2.dtype is not torch.bfloat16 or x2.shape[1] != k:
            raise TypeError(f"x must be bfloat16 [..., {k}], got {x2.dtype} {tuple(x.shape)}")
        if not x2.is_contiguous() or x2.data_ptr() % 4:
            x2 = x2.contiguous()
        m = x2.shape[0]
        if out is None:
            y = torch.empty((m, n), dtype=torch.bfloat16)
            if m:
                self._fn(x2.data_ptr(), k, m, k, self._w, n, self._b, y.data_ptr(), n, None, 0, threads)
            return y if x.dim() == 2 else y.view(*x.shape[:-1], n)
        if out.shape != (m, n) or out.stride(-1) != 1 or out.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"out must be [{m}, {n}] bfloat16 or float32 with unit column stride")
        if m:
            f32 = out.dtype is torch.float32
            self._fn(x2.data_ptr(), k, m, k, self._w, n, self._b, None if f32 else out.data_ptr(), out.stride(0),
                     out.data_ptr() if f32 else None, out.stride(0), threads)
        return out

    def dense(self) -> torch.Tensor:
        return unpack(self.packed, self.n)


def _call(fn: Any, x2: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None, out: torch.Tensor,
          threads: int) -> torch.Tensor:
    """The self-check's call: x2 [M, K] contiguous bf16 into out [M, N] bf16."""
    m, k = x2.shape
    fn(x2.data_ptr(), k, m, k, packed.data_ptr(), n, None if bias is None else bias.data_ptr(), out.data_ptr(), n,
       None, 0, threads)
    return out
