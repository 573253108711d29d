"""LFM2's short gated convolution: B, C, x = in_proj(h); y = C * conv(B * x); out_proj(y).

Its state per sequence is the convolution's window: the last conv_L_cache - 1 values of B * x.
"""

from __future__ import annotations

import torch

from engine.layers.linear import Linear
from engine.models.recurrent.conv import causal_conv
from engine.models.recurrent.state import StateBatch, StateShape


class ShortConv:
    def __init__(self, in_proj: Linear, out_proj: Linear, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """weight [hidden, L] (the checkpoint's [hidden, 1, L] conv weight squeezed)."""
        self.in_proj, self.out_proj = in_proj, out_proj
        self.weight, self.bias = weight, bias

    def state_shapes(self, dtype: torch.dtype) -> list[StateShape]:
        return [((self.weight.shape[0], self.weight.shape[1] - 1), dtype)]

    def __call__(self, h: torch.Tensor, state: tuple[torch.Tensor, ...], sb: StateBatch) -> torch.Tensor:
        b, c, x = self.in_proj(h).chunk(3, dim=-1)
        y = causal_conv(b * x, self.weight, self.bias, state[0], sb)
        return self.out_proj(c * y)
