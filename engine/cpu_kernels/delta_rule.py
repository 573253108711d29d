"""The gated delta rule's one-token decode update through delta_rule.cpp: each row's float32 state advanced in place
at its slot in one pass over it (decay, S^T k, the delta, the rank-1 update, S^T q), q and k l2-normed and q scaled
by 1/sqrt(d_k) inside, as transformers' torch_recurrent_gated_delta_rule. `usable(...)` is False where it cannot run
(engine/cpu_kernels); engine/models/recurrent/delta_decode.py then keeps its torch path.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

from engine.cpu_kernels.build import kernel

ABI = 1
MAX_DK = 1024  # delta_rule.cpp's kMaxDk
_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
_ARGS = [_P, _L, _L, _P, _L, _L, _P, _L, _L, _I, _P, _P, _P, _L, _L, _P, _P, _L, _L, _I, _I, _I, _I, _I, _I]


@functools.cache
def _kernel() -> Any:
    return kernel("delta_rule", ABI, _ARGS, check=_self_check)


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, states: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The update written out in float64 on [B, ...] states: (out [B, Hv, dv], new states); the self-check's and
    the tests' reference."""
    rep = v.shape[1] // k.shape[1]
    qd, kd = (x.double().repeat_interleave(rep, dim=1) for x in (q, k))
    qd = qd * torch.rsqrt((qd * qd).sum(-1, keepdim=True) + 1e-6) / q.shape[-1] ** 0.5
    kd = kd * torch.rsqrt((kd * kd).sum(-1, keepdim=True) + 1e-6)
    s = states.double() * g.double().exp()[..., None, None]
    delta = (v.double() - torch.einsum("bhkv,bhk->bhv", s, kd)) * beta.double()[..., None]
    s = s + kd[..., :, None] * delta[..., None, :]
    return torch.einsum("bhkv,bhk->bhv", s, qd), s


def _self_check(fn: Any) -> str | None:
    """A broken build must not reach a model: bf16 and float32 rows, a shared key head, a tail of columns, more
    columns than one block, slots out of order."""
    g = torch.Generator().manual_seed(0)
    for dtype, hk, hv, dk, dv in ((torch.bfloat16, 2, 4, 32, 24), (torch.float32, 1, 1, 16, 144)):
        states = torch.randn(5, hv, dk, dv, generator=g)
        q, k = (torch.randn(3, hk, dk, generator=g).to(dtype) for _ in range(2))
        v = torch.randn(3, hv, dv, generator=g).to(dtype)
        decay, beta = -torch.rand(3, hv, generator=g), torch.rand(3, hv, generator=g)
        slots = torch.tensor([4, 0, 2])
        want_out, want_s = reference(q, k, v, decay, beta, states[slots])
        got = _call(fn, q, k, v, decay, beta, states, slots, 1)
        err = max((got.double() - want_out).abs().max().item(), (states[slots].double() - want_s).abs().max().item())
        if err > (2e-2 if dtype == torch.bfloat16 else 1e-4):
            return f"its self-check is off by {err:.3g}"
    return None


def usable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, states: torch.Tensor) -> bool:
    """q, k [B, Hk, dk], v [B, Hv, dv] (bf16 or float32, one dtype, last dim contiguous) and states float32
    [slots, Hv, dk, dv] (each head's matrix contiguous) on CPU, with Hv a multiple of Hk."""
    dk, dv = k.shape[-1], v.shape[-1]
    return (
        v.device.type == "cpu"
        and states.device.type == "cpu"
        and v.dtype in (torch.bfloat16, torch.float32)
        and q.dtype == k.dtype == v.dtype
        and states.dtype == torch.float32
        and 0 < dk <= MAX_DK
        and dv > 0
        and v.shape[1] % k.shape[1] == 0
        and states.shape[1:] == (v.shape[1], dk, dv)
        and states.stride(-1) == 1
        and states.stride(-2) == dv
        and all(x.stride(-1) == 1 for x in (q, k, v))
        and _kernel() is not None
    )


def decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    threads: int = 1,
) -> torch.Tensor:
    """q, k [B, Hk, dk]; v [B, Hv, dv]; g (log decay), beta [B, Hv]; states [slots, Hv, dk, dv] float32; slots [B]
    distinct -> out [B, Hv, dv] in v's dtype, the rows' states advanced in place (see usable())."""
    fn = _kernel()
    if fn is None:
        raise RuntimeError("the delta_rule CPU kernel is not available here (see usable())")
    return _call(fn, q, k, v, g, beta, states, slots, threads)


def _call(
    fn: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    threads: int,
) -> torch.Tensor:
    b, hv, dv = v.shape
    hk, dk = k.shape[1:]
    gf, bf = (x.to(torch.float32).contiguous() for x in (g, beta))
    idx = slots.to(torch.int64).contiguous()
    out = torch.empty(b, hv, dv, dtype=v.dtype)
    if b:
        fn(
            q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1),
            v.data_ptr(), v.stride(0), v.stride(1), int(v.dtype == torch.bfloat16), gf.data_ptr(), bf.data_ptr(),
            states.data_ptr(), states.stride(0), states.stride(1), idx.data_ptr(), out.data_ptr(), hv * dv, dv,
            b, hk, hv, dk, dv, max(1, threads),
        )  # fmt: skip
    return out
