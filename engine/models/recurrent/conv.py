"""The causal depthwise convolution of recurrent mixers over a flat batch, each sequence from its cached window.

A sequence's window holds its last K - 1 inputs (K: the kernel size); a chunk runs the convolution over
[window | chunk] (zeros before position 0, as the reference's left padding) and keeps the new last K - 1; the
step's single-token rows go together, round after round (engine/models/recurrent/state.py Round), their
windows updated in place at their slots.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.models.recurrent.state import StateBatch

Activation = Callable[[torch.Tensor], torch.Tensor]


def _conv(inp: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """inp [B, C, K - 1 + n] -> [B, C, n]: the depthwise convolution without padding (weight [C, K])."""
    return F.conv1d(inp, weight.unsqueeze(1), bias, groups=weight.shape[0])


def _last(inp: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """inp [B, C, K] -> [B, C]: the convolution's one output per row, as a float32 product summed over K (a
    depthwise conv1d call costs far more than its few thousand products: oneDNN's setup per call)."""
    y = (inp.float() * weight.float()).sum(-1)
    return (y if bias is None else y + bias.float()).to(weight.dtype)


def causal_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    windows: torch.Tensor,
    sb: StateBatch,
    act: Activation | None = None,
) -> torch.Tensor:
    """x [T, C] -> [T, C]; windows [slots, C, K - 1] are read and advanced."""
    keep = weight.shape[-1] - 1
    out = torch.empty_like(x)
    for c in sb.chunks:
        inp = torch.cat([windows[c.slot], x[c.row : c.row + c.n].t().to(windows.dtype)], dim=-1)
        y = _conv(inp.unsqueeze(0).to(weight.dtype), weight, bias)[0].t()
        windows[c.slot] = inp[:, inp.shape[-1] - keep :]
        sb.save(c, windows)
        out[c.row : c.row + c.n] = y if act is None else act(y)
    for rnd in sb.rounds:
        inp = torch.cat([windows[rnd.slots], x[rnd.rows].unsqueeze(-1).to(windows.dtype)], dim=-1)
        windows[rnd.slots] = inp[:, :, 1:]
        sb.keep(rnd, windows)
        y = _last(inp, weight, bias)
        out[rnd.rows] = y if act is None else act(y)
    return out
