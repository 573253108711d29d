"""y = x @ W.T + b in bfloat16 through AMX tiles (gemm_amx.cpp): `w = pack(weight); y = matmul(x, w, n, bias)`.

The weight is packed once into the tiles' order (gemm_amx.cpp says how); sums are float32, rounded once to bf16,
as torch's bf16 `linear` rounds (the order of the sums differs, so results may differ from oneDNN's in the last
bit). `available()` is False where the CPU, the compiler or Linux give no AMX tiles; it is one candidate of the
kernel chooser (engine/cpu_kernels/chooser.py), which keeps it only where it measures fastest.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

from engine.cpu_kernels.build import cpu_flags, kernel

ABI = 1
PAIR = 32  # output columns per pair of tiles
STEP = 32  # inputs per tile step: K must be a multiple
_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
_ARGS = [_P, _L, _I, _I, _P, _I, _P, _P, _L, _P, _L, _I]
NEEDS = frozenset({"amx_tile", "amx_bf16"})


@functools.cache
def _kernel() -> Any:
    if not NEEDS <= cpu_flags():
        return None
    usable = kernel("gemm_amx", ABI, [], symbol="spindle_gemm_amx_usable", restype=ctypes.c_int)
    if usable is None or not usable():  # Linux refused the tile state (an old kernel, a VM that hides it)
        return None
    return kernel("gemm_amx", ABI, _ARGS, check=_self_check, restype=ctypes.c_int)


def available() -> bool:
    return _kernel() is not None


def takes(weight: torch.Tensor) -> bool:
    """Whether this weight [N, K] can be held for the kernel: bf16 on CPU, K a multiple of 32, and AMX here."""
    return (
        weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.shape[1] % STEP == 0
        and available()
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] bf16 -> the packed tiles (N padded with zero rows to a multiple of 32), a flat bf16 tensor."""
    n, k = weight.shape
    padded = torch.zeros((n + PAIR - 1) // PAIR * PAIR, k, dtype=torch.bfloat16)
    padded[:n] = weight
    # [pair, block b, column c, step s, row r, j] -> [pair, step s, block b, row r, column c, j]
    tiles = padded.view(-1, 2, 16, k // STEP, 16, 2).permute(0, 3, 1, 4, 2, 5)
    return tiles.contiguous().view(-1)


def unpack(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """pack's inverse: the weight [n, k]."""
    tiles = packed.view(-1, k // STEP, 2, 16, 16, 2).permute(0, 2, 4, 1, 3, 5)
    return tiles.reshape(-1, k)[:n].contiguous()


def matmul(
    x2: torch.Tensor,
    packed: torch.Tensor,
    n: int,
    bias: torch.Tensor | None,
    threads: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x2 [M, K] bf16 (unit column stride) @ W.T + bias -> out [M, n] (a row stride of its own may do): bf16, or
    float32 when `out` is float32 (the bf16 result widened). Raises RuntimeError where a thread may not use tiles."""
    m, k = x2.shape
    if out is None:
        out = torch.empty(m, n, dtype=torch.bfloat16)
    wide = out.dtype == torch.float32
    if _kernel()(
        x2.data_ptr(),
        x2.stride(0),
        m,
        k,
        packed.data_ptr(),
        n,
        None if bias is None else bias.data_ptr(),
        None if wide else out.data_ptr(),
        out.stride(0),
        out.data_ptr() if wide else None,
        out.stride(0),
        threads,
    ):
        raise RuntimeError("AMX tiles refused on a thread")
    return out


def _self_check(fn: Any) -> str | None:
    """Each result within one bf16 rounding of the exact product of the same bf16 inputs."""
    g = torch.Generator().manual_seed(0)
    for m, n, k in ((1, 40, 64), (5, 17, 96), (19, 64, 64), (33, 48, 128)):
        w = torch.randn(n, k, generator=g).bfloat16()
        x = torch.randn(m, k, generator=g).bfloat16()
        b = torch.randn(n, generator=g).bfloat16()
        p = pack(w)
        out = torch.empty(m, n, dtype=torch.bfloat16)
        if fn(x.data_ptr(), k, m, k, p.data_ptr(), n, b.data_ptr(), out.data_ptr(), n, None, n, 2):
            return "its tiles were refused"
        exact = x.double() @ w.double().T + b.double()
        terms = x.double().abs() @ w.double().abs().T + b.double().abs()
        slack = exact.abs() * 2.0**-8 + terms * k * 2.0**-24  # one bf16 rounding, float32 sums in any order
        if not bool(((out.double() - exact).abs() <= slack).all()):
            return f"its {m}x{n}x{k} product is off by more than a bf16 rounding"
    return None
