"""y = x @ W.T for bfloat16 x and W of GGUF blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)
through quant_dot.cpp: the blocks are repacked once (`pack`: the file's bytes, up to 4% more for K-quants' unpacked
6-bit scales) so that AVX512-BF16 dot products take 32 weights per instruction, up to 16 rows sharing each decoded
chunk; the activations are not quantized (the reference's weights up to float32 rounding). Also
`dequantize`: rows of the packed form to float32 or bfloat16, each weight as gguf's dequantizer computes it.
Checked against gguf.quants.dequantize at first use; `supports(t)` is False where the kernel cannot run or the
check failed (engine/layers/quant_linear.py then keeps the file's blocks and quant_gemm.py's kernel).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from typing import Any

import torch

from engine.cpu_kernels import quant_gemm
from engine.cpu_kernels.build import cpu_flags, kernel
from engine.gguf.ggml_types import GGMLType

log = logging.getLogger(__name__)

ABI = 3
_T = GGMLType
TYPES = frozenset(
    int(t) for t in (_T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q5_1, _T.Q8_0, _T.Q2_K, _T.Q3_K, _T.Q4_K, _T.Q5_K, _T.Q6_K)
)
# quant_gemm.cpp's spindle_quant_gemm takes the packed form of type t as type PACKED + t (the fused decode
# layer calls that one function for every GGUF projection)
PACKED = 1024
# type + (R << TILES_SHIFT): products of R rows or more through AMX tiles (quant_dot_amx.cpp; where Linux refuses
# a thread the tiles, that thread's columns go through the AVX-512 path)
TILES_SHIFT = 8
_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_long


@functools.cache
def _kernels() -> dict[str, Any] | None:
    gemm = kernel(
        "quant_dot", ABI, [_I, _P, _L, _I, _I, _P, _I, _P, _I, _L, _I], symbol="spindle_quant_dot_gemm", restype=_I
    )
    if gemm is None:
        return None
    return {
        "gemm": gemm,
        "bytes": kernel("quant_dot", ABI, [_I, _I, _I], symbol="spindle_quant_dot_bytes", restype=_L),
        "pack": kernel("quant_dot", ABI, [_I, _P, _L, _I, _I, _P], symbol="spindle_quant_dot_pack", restype=_I),
        "dequant": kernel(
            "quant_dot", ABI, [_I, _P, _I, _I, _I, _I, _P, _I, _L, _I], symbol="spindle_quant_dot_dequant", restype=_I
        ),
        "rows": kernel(
            "quant_dot", ABI, [_I, _P, _I, _P, _I, _P, _I, _L, _I], symbol="spindle_quant_dot_rows", restype=_I
        ),
        "amx": kernel("quant_dot", ABI, [], symbol="spindle_quant_dot_amx_usable", restype=_I),
    }


@functools.cache
def tiles_usable() -> bool:
    """Whether the product can run through AMX tiles here (the CPU has them and Linux grants this process the
    tile state); the chooser still times it against the AVX-512 path."""
    k = _kernels()
    return k is not None and "amx_tile" in cpu_flags() and "amx_bf16" in cpu_flags() and bool(k["amx"]())


@functools.cache
def supports(ggml_type: int) -> bool:
    """Whether weights of this type can be packed and multiplied here (it runs, and passed its check)."""
    if ggml_type not in TYPES or _kernels() is None:
        return False
    why = _self_check(ggml_type)
    if why is not None:
        log.warning("bf16 dot-product kernel for %s off: %s", _T(ggml_type).name, why)
    return why is None


def pack(data: torch.Tensor, ggml_type: int, in_features: int) -> torch.Tensor:
    """The packed form (uint8, 1-D) of W [N, in_features] held as `data` (uint8 [N, row_bytes], the file's
    blocks, contiguous rows)."""
    k = _need()
    n = data.shape[0]
    block, _ = quant_gemm.block_shape(ggml_type)
    if data.stride(1) != 1 or in_features % block:
        raise ValueError(f"data rows must be contiguous and in_features a multiple of {block}")
    out = torch.empty(int(k["bytes"](ggml_type, n, in_features)), dtype=torch.uint8)
    if k["pack"](ggml_type, data.data_ptr(), data.stride(0), n, in_features, out.data_ptr()):
        raise ValueError(f"type {ggml_type} is not packed here")
    return out


def matmul(
    x2: torch.Tensor,
    packed: torch.Tensor,
    ggml_type: int,
    n: int,
    out: torch.Tensor,
    threads: int = 1,
    tiles_from: int = 0,
) -> None:
    """out [M, n] (float32 or bfloat16, unit column stride) = x2 [M, K] (bfloat16, unit column stride) @ W.T;
    through AMX tiles where M >= tiles_from > 0 (`tiles_usable()`)."""
    m, k_in = x2.shape
    if x2.dtype is not torch.bfloat16 or x2.stride(1) != 1:
        raise TypeError(f"x must be bfloat16 with unit column stride, got {x2.dtype}")
    if out.shape != (m, n) or out.stride(1) != 1 or out.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"out must be [{m}, {n}] float32 or bfloat16 with unit column stride")
    if m and _need()["gemm"](
        ggml_type + (tiles_from << TILES_SHIFT),
        x2.data_ptr(),
        x2.stride(0),
        m,
        k_in,
        packed.data_ptr(),
        n,
        out.data_ptr(),
        int(out.dtype is torch.bfloat16),
        out.stride(0),
        threads,
    ):
        raise ValueError(f"type {ggml_type} is not packed here")


def dequantize(
    packed: torch.Tensor,
    ggml_type: int,
    n: int,
    in_features: int,
    start: int,
    end: int,
    dtype: torch.dtype,
    threads: int = 1,
) -> torch.Tensor:
    """Rows [start, end) of W [n, in_features] from its packed form, dense in float32 or bfloat16 (rounded to
    nearest even from the reference's float32 weights)."""
    if dtype not in (torch.float32, torch.bfloat16) or not 0 <= start <= end <= n:
        raise ValueError(f"rows [{start}, {end}) of {n} in {dtype} cannot be dequantized here")
    out = torch.empty(end - start, in_features, dtype=dtype)
    if end > start and _need()["dequant"](
        ggml_type,
        packed.data_ptr(),
        n,
        in_features,
        start,
        end,
        out.data_ptr(),
        int(dtype is torch.bfloat16),
        in_features,
        threads,
    ):
        raise ValueError(f"type {ggml_type} is not packed here")
    return out


def gather(
    packed: torch.Tensor, ggml_type: int, n: int, in_features: int, ids: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Rows `ids` (int64, each in [0, n)) of W [n, in_features] from its packed form, dense in float32 or bfloat16,
    as `dequantize` gives them (an embedding table's lookup)."""
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    if dtype not in (torch.float32, torch.bfloat16) or (
        flat.numel() and not 0 <= int(flat.min()) <= int(flat.max()) < n
    ):
        raise ValueError(f"rows of {n} in {dtype} cannot be gathered here")
    out = torch.empty(flat.numel(), in_features, dtype=dtype)
    if flat.numel() and _need()["rows"](
        ggml_type,
        packed.data_ptr(),
        in_features,
        flat.data_ptr(),
        flat.numel(),
        out.data_ptr(),
        int(dtype is torch.bfloat16),
        in_features,
        1,
    ):
        raise ValueError(f"type {ggml_type} is not packed here")
    return out


def _need() -> dict[str, Any]:
    k = _kernels()
    if k is None:
        raise ValueError("the bf16 dot-product kernel does not run here")
    return k


def _self_check(ggml_type: int) -> str | None:
    """The packed weights must dequantize to the reference's bit for bit, and products of bf16 rows must be the
    reference's within float32 rounding (plus the bf16 output's one rounding)."""
    g = torch.Generator().manual_seed(ggml_type)
    n, k = 7, 256
    data = quant_gemm.random_blocks(ggml_type, n, k, g)
    want = quant_gemm.reference(data, ggml_type)
    packed = pack(data, ggml_type, k)
    if not torch.equal(dequantize(packed, ggml_type, n, k, 0, n, torch.float32), want):
        return "its dequantization differs from gguf's"
    for rows, tiles_from in ((1, 0), (3, 0), (13, 0), (19, 1 if tiles_usable() else 0)):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
            y = torch.empty(rows, n, dtype=dtype)
            matmul(x, packed, ggml_type, n, y, 2, tiles_from)
            exact = x.double() @ want.double().t()
            # float32 sums of exact products, and the block sums taken out again: 64 ulps of the |products|
            bound = 64 * 2.0**-24 * (x.double().abs() @ want.double().abs().t())
            if dtype is torch.bfloat16:
                bound += 2.0**-8 * exact.abs()
            if not ((y.double() - exact).abs() <= bound).all():
                return f"its product of {rows} rows is off by {(y.double() - exact).abs().max().item():.3g}"
    return None
