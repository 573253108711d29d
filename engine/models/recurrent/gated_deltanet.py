"""Qwen3.5's Gated DeltaNet: linear attention whose state per head is a d_k x d_v matrix updated by the gated
delta rule, after a causal convolution over q|k|v (its window is the second state).

Chunks run transformers' chunked delta rule (its torch reference) from the slot's state; the step's single-token
sequences run the recurrent form together, their states updated in place (engine/models/recurrent/delta_decode.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from engine.layers.linear import Linear
from engine.models.args import ConfigError
from engine.models.recurrent.conv import causal_conv
from engine.models.recurrent.delta_decode import delta_rule_decode
from engine.models.recurrent.state import StateBatch, StateShape

DeltaRule = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


def delta_rule_kernels() -> tuple[DeltaRule, DeltaRule]:
    """(chunked, recurrent) gated delta rules: transformers' exact torch references (the recurrent one: tests)."""
    try:  # why late: only a Qwen3.5 model needs them, and the module is slow to import
        from transformers.models.qwen3_5 import modeling_qwen3_5 as ref
    except ImportError:
        try:
            from transformers.models.qwen3_next import modeling_qwen3_next as ref  # type: ignore[no-redef]
        except ImportError as e:
            raise ConfigError("Gated DeltaNet layers need transformers with Qwen3.5 or Qwen3-Next") from e
    return ref.torch_chunk_gated_delta_rule, ref.torch_recurrent_gated_delta_rule


@dataclass(frozen=True)
class DeltaNetDims:
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    kernel: int
    eps: float

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim


class GatedDeltaNet:
    def __init__(self, dims: DeltaNetDims, projections: dict[str, Linear], tensors: dict[str, torch.Tensor]) -> None:
        """projections: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj; tensors: conv (weight [C, K]),
        A_log, dt_bias, norm (the gated norm's weight)."""
        self.dims = dims
        self.qkv, self.z, self.b, self.a, self.out = (
            projections[n] for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
        )
        self.conv, self.norm_weight = tensors["conv"], tensors["norm"]
        self.neg_a = -tensors["A_log"].float().exp()
        self.dt_bias = tensors["dt_bias"]
        self.chunked, self.recurrent = delta_rule_kernels()

    def state_shapes(self, dtype: torch.dtype) -> list[StateShape]:
        d = self.dims
        return [
            ((self.conv.shape[0], d.kernel - 1), dtype),
            ((d.num_v_heads, d.head_k_dim, d.head_v_dim), torch.float32),
        ]

    def __call__(self, h: torch.Tensor, state: tuple[torch.Tensor, ...], sb: StateBatch) -> torch.Tensor:
        d, t = self.dims, h.shape[0]
        mixed = causal_conv(self.qkv(h), self.conv, None, state[0], sb, F.silu)
        q, k, v = torch.split(mixed, [d.key_dim, d.key_dim, d.value_dim], dim=-1)
        q, k = q.reshape(t, d.num_k_heads, d.head_k_dim), k.reshape(t, d.num_k_heads, d.head_k_dim)
        v = v.reshape(t, d.num_v_heads, d.head_v_dim)
        beta = self.b(h).sigmoid()
        g = self.neg_a * F.softplus(self.a(h).float() + self.dt_bias)
        core = self._rule(q, k, v, g, beta, state[1], sb)
        return self.out(self._gated_norm(core, self.z(h).reshape(t, d.num_v_heads, d.head_v_dim)).reshape(t, -1))

    def _gated_norm(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """RMSNorm over each head (float32, weight times the rounded norm), times silu(gate) in float32."""
        dtype = x.dtype
        xf = x.float()
        normed = self.norm_weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.dims.eps)).to(dtype)
        return (normed * F.silu(gate.float())).to(dtype)

    def _rule(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        states: torch.Tensor,
        sb: StateBatch,
    ) -> torch.Tensor:
        """Per sequence: its chunk's outputs [n, Hv, dv] from its slot's state, which it advances in place."""
        out = v.new_empty(v.shape)
        kw: dict[str, Any] = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
        for c in sb.chunks:
            r = slice(c.row, c.row + c.n)
            o, final = self.chunked(
                q[None, r],
                k[None, r],
                v[None, r],
                g=g[None, r],
                beta=beta[None, r],
                initial_state=states[c.slot][None],
                **kw,
            )
            out[r] = o[0]
            assert final is not None
            states[c.slot] = final[0]
            sb.save(c, states)
        for rnd in sb.rounds:
            rows = rnd.rows
            out[rows] = delta_rule_decode(q[rows], k[rows], v[rows], g[rows], beta[rows], states, rnd.slots)
            sb.keep(rnd, states)
        return out
