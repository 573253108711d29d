"""A decoder layer's small bfloat16 ops through layer_ops.cpp, one pass each instead of several torch ops:
`add_rms_norm`, `gemma_rms_norm` (float32 (1 + w) weights), `rope` (in place), `silu_mul`, `gelu_tanh_mul`.
Each rounds where the torch code it replaces rounds (layer_ops.cpp). `usable(x)` is False where they cannot run
(engine/cpu_kernels); callers keep torch's ops.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from typing import Any

import torch
import torch.nn.functional as F

from engine.cpu_kernels.build import kernel

log = logging.getLogger(__name__)

ABI = 2
_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "spindle_add_rms_norm": [_P, _L, _P, _L, _P, _P, _L, _P, _L, _I, _I, _F, _I],
    "spindle_rope": [_P, _L, _L, _I, _I, _I, _P, _P, _L, _I],
    "spindle_silu_mul": [_P, _L, _P, _L, _I, _I, _I],
    "spindle_add_rms_norm_f32w": [_P, _L, _P, _L, _P, _P, _L, _P, _L, _I, _I, _F, _I],
    "spindle_gelu_tanh_mul": [_P, _L, _P, _L, _I, _I, _I],
}


@functools.cache
def _kernels() -> dict[str, Any] | None:
    fns = {sym: kernel("layer_ops", ABI, args, sym) for sym, args in _SIGNATURES.items()}
    if any(fn is None for fn in fns.values()):
        return None
    if (why := _self_check(fns)) is not None:
        log.warning("CPU kernel layer_ops off: %s", why)
        return None
    return fns


def _self_check(fns: dict[str, Any]) -> str | None:
    g = torch.Generator().manual_seed(0)
    x, h, w = (torch.randn(3, 40, generator=g).bfloat16() for _ in range(3))
    _, normed = _add_rms_norm(fns, x, h, w[0], 1e-6, 1)
    s = (x + h).float()
    want = w[0] * (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()
    gu = torch.randn(3, 80, generator=g).bfloat16()
    got = _silu_mul(fns, gu, 1)
    gelu = _act_mul(fns, "spindle_gelu_tanh_mul", gu, 1)
    wf = 1.0 + w[1].float()
    gemma = _gemma_rms_norm(fns, x, wf, 1e-6, 1)
    xf = x.float()
    want_gemma = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * wf
    close = functools.partial(torch.allclose, rtol=2e-2, atol=2e-2)
    if not (
        close(normed.float(), want.float())
        and close(got.float(), (F.silu(gu[:, :40]) * gu[:, 40:]).float())
        and close(gelu.float(), (F.gelu(gu[:, :40], approximate="tanh") * gu[:, 40:]).float())
        and close(gemma.float(), want_gemma)
    ):
        return "its self-check is off"
    return None


def available() -> bool:
    return _kernels() is not None


def usable(x: torch.Tensor) -> bool:
    """Whether x (bfloat16 on CPU, unit stride along its last dim) can go through these kernels."""
    return x.device.type == "cpu" and x.dtype == torch.bfloat16 and x.stride(-1) == 1 and _kernels() is not None


def _fns() -> dict[str, Any]:
    fns = _kernels()
    if fns is None:
        raise RuntimeError("the layer_ops CPU kernels are not available here (see usable())")
    return fns


def add_rms_norm(
    x: torch.Tensor, h: torch.Tensor | None, weight: torch.Tensor, eps: float, threads: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + h, weight * rms_norm(x + h)) for rows [T, n] in bf16, as `x + h` then engine/layers/ops.py's rms_norm
    round them; h None: (x, weight * rms_norm(x))."""
    return _add_rms_norm(_fns(), x, h, weight, eps, threads)


def _rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """x as contiguous bf16 rows [T, n] (a view where it can be)."""
    x2 = x if x.dim() == 2 else x.reshape(-1, n)
    if x2.dtype is not torch.bfloat16:
        raise ValueError(f"rows must be bfloat16, got {x2.dtype}")
    return x2 if x2.is_contiguous() else x2.contiguous()


def _add_rms_norm(
    fns: dict[str, Any], x: torch.Tensor, h: torch.Tensor | None, weight: torch.Tensor, eps: float, threads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.shape[-1]
    x2 = _rows(x, n)
    if weight.dtype is not torch.bfloat16 or weight.shape != (n,) or weight.stride(0) != 1:
        raise ValueError(f"weight must be a contiguous bfloat16 [{n}]")
    norm = torch.empty(x2.shape, dtype=torch.bfloat16)
    if h is None:
        fns["spindle_add_rms_norm"](
            x2.data_ptr(),
            n,
            None,
            0,
            weight.data_ptr(),
            x2.data_ptr(),
            n,
            norm.data_ptr(),
            n,
            x2.shape[0],
            n,
            eps,
            threads,
        )
        return x, norm.view(x.shape)
    h2 = _rows(h, n)
    if h2.shape != x2.shape:
        raise ValueError(f"h {tuple(h.shape)} must match x {tuple(x.shape)}")
    out = torch.empty(x2.shape, dtype=torch.bfloat16)
    fns["spindle_add_rms_norm"](
        x2.data_ptr(),
        n,
        h2.data_ptr(),
        n,
        weight.data_ptr(),
        out.data_ptr(),
        n,
        norm.data_ptr(),
        n,
        x2.shape[0],
        n,
        eps,
        threads,
    )
    return out.view(x.shape), norm.view(x.shape)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, threads: int = 1) -> torch.Tensor:
    """Rotate x [T, heads, d] in place by cos, sin [T, d/2] bf16 (the non-interleaved halves); returns x."""
    t, heads, d = x.shape
    if (
        d % 2
        or x.stride(-1) != 1
        or cos.shape != (t, d // 2)
        or sin.shape != cos.shape
        or cos.stride() != sin.stride()
        or cos.stride(-1) != 1
        or cos.dtype != torch.bfloat16
        or sin.dtype != torch.bfloat16
    ):
        raise ValueError("rope takes x [T, heads, even d] and cos, sin [T, d/2] bf16 with unit stride")
    if t:
        _fns()["spindle_rope"](
            x.data_ptr(), x.stride(0), x.stride(1), t, heads, d, cos.data_ptr(), sin.data_ptr(), cos.stride(0), threads
        )
    return x


def silu_mul(gate_up: torch.Tensor, threads: int = 1) -> torch.Tensor:
    """silu(gate) * up for gate_up [..., 2n] = gate | up, rounded as `F.silu(gate) * up` in bf16."""
    return _silu_mul(_fns(), gate_up, threads)


def gelu_tanh_mul(gate_up: torch.Tensor, threads: int = 1) -> torch.Tensor:
    """gelu_tanh(gate) * up for gate_up [..., 2n] = gate | up, rounded as `F.gelu(gate, approximate="tanh") * up`
    in bf16 (tanh's last float32 bits may differ from torch's, so a result rarely moves one bf16 step)."""
    return _act_mul(_fns(), "spindle_gelu_tanh_mul", gate_up, threads)


def _silu_mul(fns: dict[str, Any], gate_up: torch.Tensor, threads: int) -> torch.Tensor:
    return _act_mul(fns, "spindle_silu_mul", gate_up, threads)


def _act_mul(fns: dict[str, Any], symbol: str, gate_up: torch.Tensor, threads: int) -> torch.Tensor:
    n2 = gate_up.shape[-1]
    if n2 % 2:
        raise ValueError("gate_up must have an even last dim")
    g2 = _rows(gate_up, n2)
    out = torch.empty((g2.shape[0], n2 // 2), dtype=torch.bfloat16)
    fns[symbol](g2.data_ptr(), n2, out.data_ptr(), n2 // 2, g2.shape[0], n2 // 2, threads)
    return out if gate_up.dim() == 2 else out.view(*gate_up.shape[:-1], n2 // 2)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, threads: int = 1) -> torch.Tensor:
    """Gemma's RMSNorm of bf16 rows [..., n] by float32 weight [n] holding (1 + w), rounded once as
    engine/models/decoder.py's torch form (the float32 sum of squares taken in another order)."""
    return _gemma_rms_norm(_fns(), x, weight, eps, threads)


def _gemma_rms_norm(
    fns: dict[str, Any], x: torch.Tensor, weight: torch.Tensor, eps: float, threads: int
) -> torch.Tensor:
    n = x.shape[-1]
    x2 = _rows(x, n)
    if weight.dtype is not torch.float32 or weight.shape != (n,) or weight.stride(0) != 1:
        raise ValueError(f"weight must be a contiguous float32 [{n}]")
    norm = torch.empty(x2.shape, dtype=torch.bfloat16)
    fns["spindle_add_rms_norm_f32w"](
        x2.data_ptr(), n, None, 0, weight.data_ptr(), x2.data_ptr(), n, norm.data_ptr(), n, x2.shape[0], n, eps, threads
    )
    return norm.view(x.shape)
