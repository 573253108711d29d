"""y = x @ W.T on CPU with W kept as a GGUF file's quantized blocks, through quant_gemm.cpp: each block is
dequantized in registers and the products summed in float32; the activations (float32 or bfloat16) are not
quantized. Also `dequantize`: rows of blocks to float32 or bfloat16 (for products whose many rows favour torch's
GEMM on a dequantized tile). Each type is checked against gguf.quants.dequantize at its first use; `supports(t)`
is False for a type the kernel does not compute, where the kernel cannot run, or where that check failed.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from typing import Any

import numpy as np
import torch

from engine.cpu_kernels.build import kernel
from engine.gguf.ggml_types import GGMLType

log = logging.getLogger(__name__)

ABI = 1
_T = GGMLType
# the block types quant_gemm.cpp computes, and where each block holds float16 scales (random blocks need sane ones)
HALF_FIELDS: dict[int, tuple[int, ...]] = {
    int(_T.Q8_0): (0,),
    int(_T.Q4_1): (0, 2),
    int(_T.Q4_0): (0,),
    int(_T.Q5_0): (0,),
    int(_T.Q5_1): (0, 2),
    int(_T.Q4_K): (0, 2),
    int(_T.Q6_K): (208,),
    int(_T.Q5_K): (0, 2),
    int(_T.Q3_K): (108,),
    int(_T.Q2_K): (80, 82),
}
KERNEL_TYPES: frozenset[int] = frozenset(HALF_FIELDS)
_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
_GEMM_ARGS = [_I, _P, _I, _L, _I, _I, _P, _L, _I, _P, _I, _L, _I]
_DEQUANT_ARGS = [_I, _P, _L, _I, _I, _P, _I, _L, _I]


@functools.cache
def _kernels() -> tuple[Any, Any] | None:
    product = kernel("quant_gemm", ABI, _GEMM_ARGS, restype=_I)
    if product is None:
        return None
    return product, kernel("quant_gemm", ABI, _DEQUANT_ARGS, symbol="spindle_quant_dequant", restype=_I)


def available() -> bool:
    """Whether the kernel library runs here (AVX-512 with BF16, a compiler): without it every product over blocks
    dequantizes them in Python first, and a loader does better to dequantize once at load."""
    return _kernels() is not None


def raw_product() -> Any:
    """The C product itself, for a caller's per-step path (its arguments as `_call` passes them: type, x, x is
    bf16, x's row stride, M, K, blocks, row bytes, N, out, out is bf16, out's row stride, threads; nonzero back for
    a type it does not compute), or None where the library does not run. Check the type with `supports` first."""
    kernels = _kernels()
    return None if kernels is None else kernels[0]


@functools.cache  # a dict lookup on the per-product path
def block_shape(ggml_type: int) -> tuple[int, int]:
    """(weights per block, bytes per block) of a ggml type."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # why late: gguf imports mistral_common (+0.5 s)

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    return int(block), int(size)


def random_blocks(ggml_type: int, rows: int, in_features: int, generator: torch.Generator) -> torch.Tensor:
    """uint8 [rows, row_bytes]: random bytes, each block's float16 scales set to finite values of either sign
    (every bit pattern is a valid block otherwise), for types gguf cannot quantize (the K-quants) as for any."""
    block, size = block_shape(ggml_type)
    blocks = rows * in_features // block
    data = torch.randint(0, 256, (blocks, size), dtype=torch.uint8, generator=generator)
    for at in HALF_FIELDS[ggml_type]:
        scale = (torch.randn(blocks, generator=generator) / 64).to(torch.float16)
        data[:, at : at + 2] = scale.view(torch.uint8).view(blocks, 2)
    return data.view(rows, in_features // block * size).contiguous()


def reference(data: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """gguf.quants.dequantize of rows of blocks: float32 [rows, in_features]."""
    from gguf import GGMLQuantizationType  # why late: see block_shape
    from gguf.quants import dequantize as reference_dequantize

    return torch.from_numpy(
        np.ascontiguousarray(reference_dequantize(data.numpy(), GGMLQuantizationType(ggml_type)), dtype=np.float32)
    )


@functools.cache
def supports(ggml_type: int) -> bool:
    """Whether the kernel computes this type here: it runs on this CPU and passed its check for the type."""
    kernels = _kernels() if ggml_type in KERNEL_TYPES else None
    if kernels is None:
        return False
    why = _self_check(ggml_type, *kernels)
    if why is not None:
        log.warning("quantized kernel for %s off (its dequantized path runs): %s", _T(ggml_type).name, why)
    return why is None


def _self_check(ggml_type: int, product: Any, dequant: Any) -> str | None:
    """A broken build must not reach a model: the weights must be the reference's bit for bit, and a product
    of rows of both dtypes within float32 summation error of the reference's."""
    g = torch.Generator().manual_seed(ggml_type)
    block, _ = block_shape(ggml_type)
    n, k = 7, 2 * max(block, 128)
    data = random_blocks(ggml_type, n, k, g)
    want = reference(data, ggml_type)
    got = torch.empty(n, k)
    if dequant(ggml_type, data.data_ptr(), data.shape[1], n, k, got.data_ptr(), 0, k, 2) or not torch.equal(got, want):
        return "its dequantization differs from gguf's"
    for rows in (1, 3, 13):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(rows, k, generator=g).to(dtype)
            y = torch.empty(rows, n, dtype=dtype)
            _call(product, ggml_type, x, data, y, 2)
            exact = x.double() @ want.double().t()
            # float32 sums in another order: k ulps of the sum of |products|; bf16 output: its one rounding
            bound = k * 2.0**-24 * (x.double().abs() @ want.double().abs().t())
            if dtype is torch.bfloat16:
                bound += 2.0**-8 * exact.abs()
            if not ((y.double() - exact).abs() <= bound).all():
                return f"its product of {rows} {dtype} rows is off by {(y.double() - exact).abs().max().item():.3g}"
    return None


def _call(product: Any, ggml_type: int, x2: torch.Tensor, data: torch.Tensor, out: torch.Tensor, threads: int) -> None:
    m, k = x2.shape
    if product(
        ggml_type,
        x2.data_ptr(),
        int(x2.dtype is torch.bfloat16),
        x2.stride(0),
        m,
        k,
        data.data_ptr(),
        data.shape[1],
        data.shape[0],
        out.data_ptr(),
        int(out.dtype is torch.bfloat16),
        out.stride(0),
        threads,
    ):
        raise ValueError(f"the quantized kernel does not compute type {ggml_type}")


def matmul(x2: torch.Tensor, data: torch.Tensor, ggml_type: int, out: torch.Tensor, threads: int = 1) -> torch.Tensor:
    """out [M, N] (float32 or bfloat16, unit column stride) = x2 [M, K] (float32 or bfloat16, unit column stride)
    @ W.T, W [N, K] as `data` (uint8 [N, row_bytes], contiguous) of a type `supports`."""
    m, k = x2.shape
    n = data.shape[0]
    block, size = block_shape(ggml_type)
    if k % block or data.shape[1] != k // block * size or data.stride(1) != 1 or data.stride(0) != data.shape[1]:
        raise ValueError(f"data must be contiguous uint8 [N, {k // block * size}] for {k} inputs")
    if x2.dtype not in (torch.float32, torch.bfloat16) or x2.stride(1) != 1:
        raise TypeError(f"x must be float32 or bfloat16 with unit column stride, got {x2.dtype}")
    if out.shape != (m, n) or out.stride(1) != 1 or out.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"out must be [{m}, {n}] float32 or bfloat16 with unit column stride")
    kernels = _kernels()
    if not supports(ggml_type) or kernels is None:
        raise ValueError(f"the quantized kernel does not compute {_T(ggml_type).name} here")
    if m:
        _call(kernels[0], ggml_type, x2, data, out, threads)
    return out


def dequantize(
    data: torch.Tensor, ggml_type: int, in_features: int, dtype: torch.dtype, threads: int = 1
) -> torch.Tensor:
    """The weights [N, in_features] of `data` (uint8 [N, row_bytes], contiguous rows) in float32 or bfloat16
    (bfloat16 rounded to nearest even from the exact float32 weights), for a type `supports`."""
    kernels = _kernels()
    if dtype not in (torch.float32, torch.bfloat16) or not supports(ggml_type) or kernels is None:
        raise ValueError(f"the quantized kernel does not dequantize {_T(ggml_type).name} to {dtype} here")
    n = data.shape[0]
    out = torch.empty(n, in_features, dtype=dtype)
    if n and data.stride(1) == 1:
        kernels[1](
            ggml_type,
            data.data_ptr(),
            data.stride(0),
            n,
            in_features,
            out.data_ptr(),
            int(dtype is torch.bfloat16),
            in_features,
            threads,
        )
    elif n:
        raise ValueError("data rows must have unit byte stride")
    return out
