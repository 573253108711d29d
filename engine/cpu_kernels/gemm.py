"""y = x @ W.T + b in bfloat16 on CPU through gemm_bf16.cpp: `w = PackedWeight(weight, bias); y = w(x, threads)`.

The weight is packed once at load (gemm_bf16.cpp says how and why); results round as torch's bf16 `linear`
does (float32 sums, one rounding). Weight-only int8: `PackedWeight(q, bias, scale=s)` with q int8 [N, K] and
s float32 [N] computes x @ (q * s[:, None]).T + b the same way, streaming half the bytes.
`available()` is False where the kernel cannot run (engine/cpu_kernels).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

from engine.cpu_kernels.build import kernel

ABI = 4
BLOCK = 16  # output columns per packed block
_GATED_ROWS = 32  # the gated call takes up to two row tiles (gemm_bf16.cpp: gated())
_P = ctypes.c_void_p
_ARGS = [
    _P,
    ctypes.c_long,
    ctypes.c_int,
    ctypes.c_int,
    _P,
    _P,
    ctypes.c_int,
    _P,
    _P,
    ctypes.c_long,
    _P,
    ctypes.c_long,
    ctypes.c_int,
]
_GATED_ARGS = _ARGS[:8] + [_P, ctypes.c_long, ctypes.c_int]  # spindle_gemm_bf16_silu: act and its stride, threads


@functools.cache
def _kernel() -> Any:
    return kernel("gemm_bf16", ABI, _ARGS, check=_self_check)


@functools.cache
def _gated_kernel() -> Any:
    """spindle_gemm_bf16_silu (the product's tiles, checked through _kernel()), or None where that is off."""
    if _kernel() is None:
        return None
    return kernel("gemm_bf16", ABI, _GATED_ARGS, symbol="spindle_gemm_bf16_silu", restype=ctypes.c_int)


def _self_check(fn: Any) -> str | None:
    """A broken build (a compiler that miscompiles, a CPU that lies about a flag) must not reach a model."""
    g = torch.Generator().manual_seed(0)
    for m, n, k in ((1, 40, 64), (5, 17, 96), (19, 33, 64)):
        for int8 in (False, True):
            w = torch.randn(n, k, generator=g).bfloat16()
            scale = torch.rand(n, generator=g) / 64 if int8 else None
            if scale is not None:
                w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
            x = torch.randn(m, k, generator=g).bfloat16()
            ref = x.double() @ w.double().t() * (1 if scale is None else scale.double())
            got = _call(fn, x, pack(w), scale, n, torch.empty(m, n, dtype=torch.bfloat16))
            if not torch.allclose(got.double(), ref, rtol=1e-2, atol=1e-2):
                kind = "int8" if int8 else "bf16"
                return (
                    f"its {kind} self-check at {m}x{k} @ {k}x{n} is off by "
                    f"{(got.double() - ref).abs().max().item():.3g}"
                )
    return None


def available() -> bool:
    return _kernel() is not None


def usable(weight: torch.Tensor) -> bool:
    """Whether this weight [out, in] can go through the kernel: bfloat16 on CPU, `in` even, kernel available.
    (Quantized to int8, it still can: the activations stay bfloat16.)"""
    return weight.dtype == torch.bfloat16 and _fits(weight)


def _fits(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dim() == 2 and weight.shape[1] % 2 == 0 and available()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] (bf16 or int8) -> [ceil(N/16), K/2, 16, 2]: blocks of 16 output columns, a pair of k per
    64 bytes (bf16) or 32 (int8)."""
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
    a decode step makes about a hundred of them. With `scale` (float32 [N]) the weight is int8 (weight-only
    quantization: the weight is q * scale[:, None]). `w_ptr`, `scale_ptr`, `bias_ptr`: what the C++ reads
    (engine/models/fused_decode.py hands them on)."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, scale: torch.Tensor | None = None
    ) -> None:
        if weight.dtype != (torch.bfloat16 if scale is None else torch.int8) or not _fits(weight):
            raise ValueError(
                "PackedWeight takes a CPU weight [N, even K], bfloat16 or int8 with a scale, where the kernel runs"
            )
        self.n, self.k = int(weight.shape[0]), int(weight.shape[1])
        if bias is not None and (bias.dtype != torch.bfloat16 or bias.numel() != self.n):
            raise ValueError(f"bias must be bfloat16 [{self.n}]")
        if scale is not None and (scale.dtype != torch.float32 or scale.numel() != self.n):
            raise ValueError(f"scale must be float32 [{self.n}]")
        self.packed = pack(weight)
        self.bias = None if bias is None else bias.contiguous()
        self.scale = None if scale is None else scale.contiguous()
        self.w_ptr = self.packed.data_ptr()
        self.bias_ptr = None if self.bias is None else self.bias.data_ptr()
        self.scale_ptr = None if self.scale is None else self.scale.data_ptr()
        self.nbytes = self.packed.nbytes
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
                self._fn(
                    x2.data_ptr(),
                    k,
                    m,
                    k,
                    self.w_ptr,
                    self.scale_ptr,
                    n,
                    self.bias_ptr,
                    y.data_ptr(),
                    n,
                    None,
                    0,
                    threads,
                )
            return y if x.dim() == 2 else y.view(*x.shape[:-1], n)
        if out.shape != (m, n) or out.stride(-1) != 1 or out.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"out must be [{m}, {n}] bfloat16 or float32 with unit column stride")
        if m:
            f32 = out.dtype is torch.float32
            self._fn(
                x2.data_ptr(),
                k,
                m,
                k,
                self.w_ptr,
                self.scale_ptr,
                n,
                self.bias_ptr,
                None if f32 else out.data_ptr(),
                out.stride(0),
                out.data_ptr() if f32 else None,
                out.stride(0),
                threads,
            )
        return out

    def silu_mul(self, x: torch.Tensor, threads: int = 1) -> torch.Tensor | None:
        """For a gate|up weight (N = 2n): bf16(bf16(silu(g)) * u) [M, n] where [g | u] = self(x), rounded as
        self(x) then layer_ops.silu_mul round it, in one call that keeps [g | u] in registers; None where that call
        does not apply (more rows than a decode step's, or n not a multiple of 16)."""
        if x.dtype is not torch.bfloat16 or x.dim() == 0 or x.shape[-1] != self.k:
            raise TypeError(f"x must be bfloat16 [..., {self.k}], got {x.dtype} {tuple(x.shape)}")
        m, half = x.numel() // self.k, self.n // 2
        fn = _gated_kernel()
        if fn is None or not 0 < m <= _GATED_ROWS or self.n % 32:  # declined before a prefill's rows are copied
            return None
        x2 = x if x.dim() == 2 and x.is_contiguous() and x.data_ptr() % 4 == 0 else x.reshape(-1, self.k).contiguous()
        act = torch.empty((m, half), dtype=torch.bfloat16)
        if not fn(
            x2.data_ptr(),
            self.k,
            m,
            self.k,
            self.w_ptr,
            self.scale_ptr,
            self.n,
            self.bias_ptr,
            act.data_ptr(),
            half,
            threads,
        ):
            return None
        return act if x.dim() == 2 else act.view(*x.shape[:-1], half)

    def dense(self) -> torch.Tensor:
        """The weight [N, K] as packed (int8 without its scale)."""
        return unpack(self.packed, self.n)


def _call(
    fn: Any, x2: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor | None, n: int, out: torch.Tensor
) -> torch.Tensor:
    """The self-check's call: x2 [M, K] contiguous bf16 into out [M, N] bf16, on two threads."""
    m, k = x2.shape
    fn(
        x2.data_ptr(),
        k,
        m,
        k,
        packed.data_ptr(),
        None if scale is None else scale.data_ptr(),
        n,
        None,
        out.data_ptr(),
        n,
        None,
        0,
        2,
    )
    return out
