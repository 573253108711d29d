"""Mamba-2 (state space duality) mixer, as Granite 4.0-H runs it: in_proj gives the gate, x|B|C and dt; a causal
convolution over x|B|C (its window is one state), then the selective scan whose state per head is a
head_dim x d_state matrix (the other state), a gated group RMSNorm, out_proj.

Chunks run transformers' chunked SSD scan from the slot's state; the step's single-token sequences run the
selective state update together. Both kernels are transformers' torch references.
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
from engine.models.recurrent.state import StateBatch, StateShape

Kernel = Callable[..., Any]


def ssd_kernels() -> tuple[Kernel, Kernel]:
    """(chunked scan, single-step update): transformers' exact torch references."""
    try:  # why late: only a Mamba-2 model needs them, and the module is slow to import
        from transformers.models.granitemoehybrid import modeling_granitemoehybrid as ref
    except ImportError as e:
        raise ConfigError("Mamba-2 layers need transformers with GraniteMoeHybrid") from e
    return ref.mamba2_chunk_scan, ref.mamba2_selective_state_update


@dataclass(frozen=True)
class SSDDims:
    num_heads: int
    head_dim: int
    state_size: int
    groups: int
    kernel: int
    chunk_size: int
    eps: float
    dt_limit: tuple[float, float]

    @property
    def inner(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.inner + 2 * self.groups * self.state_size


class Mamba2:
    def __init__(self, dims: SSDDims, in_proj: Linear, out_proj: Linear, tensors: dict[str, torch.Tensor | None]):
        """tensors: conv (weight [C, K]), conv_bias (or None), A_log, D, dt_bias, norm (the gated norm's weight)."""
        self.dims, self.in_proj, self.out_proj = dims, in_proj, out_proj
        t = {k: v for k, v in tensors.items() if v is not None}
        self.conv, self.conv_bias = t["conv"], tensors.get("conv_bias")
        self.a = -torch.exp(t["A_log"].float())
        self.d, self.dt_bias, self.norm_weight = t["D"], t["dt_bias"], t["norm"]
        self.chunked, self.step = ssd_kernels()

    def state_shapes(self, dtype: torch.dtype) -> list[StateShape]:
        d = self.dims
        return [((d.conv_dim, d.kernel - 1), dtype), ((d.num_heads, d.head_dim, d.state_size), torch.float32)]

    def __call__(self, h: torch.Tensor, state: tuple[torch.Tensor, ...], sb: StateBatch) -> torch.Tensor:
        d = self.dims
        gate, xbc, dt = torch.split(self.in_proj(h), [d.inner, d.conv_dim, d.num_heads], dim=-1)
        xbc = causal_conv(xbc, self.conv, self.conv_bias, state[0], sb, F.silu)
        x, b, c = torch.split(xbc, [d.inner, d.groups * d.state_size, d.groups * d.state_size], dim=-1)
        normed = self._gated_norm(self._scan(x, b, c, dt, state[1], sb), gate)
        out = (self.norm_weight.float() * normed).to(h.dtype)
        rows = sb.single_rows
        if rows is not None and h.dtype != torch.float32:  # a single step's output is in the model dtype
            out[rows] = self.norm_weight * normed[rows].to(h.dtype)  # there, rounded first
        return self.out_proj(out)

    def _scan(
        self, x: torch.Tensor, b: torch.Tensor, c: torch.Tensor, dt: torch.Tensor, ssm: torch.Tensor, sb: StateBatch
    ) -> torch.Tensor:
        """[T, inner] float32: each chunk from its slot's state, the single-token rows in one update."""
        d = self.dims
        out = x.new_empty(x.shape, dtype=torch.float32)
        for ch in sb.chunks:
            r, n = slice(ch.row, ch.row + ch.n), ch.n
            y, final = self.chunked(
                x[None, r].reshape(1, n, d.num_heads, d.head_dim),
                dt[None, r],
                self.a,
                b[None, r].reshape(1, n, d.groups, d.state_size),
                c[None, r].reshape(1, n, d.groups, d.state_size),
                chunk_size=d.chunk_size,
                D=self.d,
                dt_bias=self.dt_bias,
                initial_states=ssm[ch.slot][None],
                dt_softplus=True,
                dt_limit=d.dt_limit,
                return_final_states=True,
            )
            out[r] = y.reshape(n, d.inner)
            ssm[ch.slot] = final[0]
            sb.save(ch, ssm)
        for rnd in sb.rounds:
            rows, slots, m = rnd.rows, rnd.slots, rnd.rows.shape[0]
            held = ssm[slots]  # a copy: the update writes into it, then it goes back to the slots
            y = self.step(
                held,
                x[rows].reshape(m, d.num_heads, d.head_dim),
                dt[rows][:, :, None].expand(-1, -1, d.head_dim),
                self.a[:, None, None].expand(-1, d.head_dim, d.state_size),
                b[rows].reshape(m, d.groups, d.state_size),
                c[rows].reshape(m, d.groups, d.state_size),
                self.d[:, None].expand(-1, d.head_dim),
                z=None,
                dt_bias=self.dt_bias[:, None].expand(-1, d.head_dim),
                dt_softplus=True,
            )
            ssm[slots] = held
            sb.keep(rnd, ssm)
            out[rows] = y.reshape(m, d.inner).float()
        return out

    def _gated_norm(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """y * silu(gate) in float32, RMS-normed per group of inner / groups channels (float32; the caller applies
        the weight as transformers does for each kind of row)."""
        d = self.dims
        g = (y.float() * F.silu(gate.float())).view(y.shape[0], d.groups, -1)
        return (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + d.eps)).view(y.shape)
