"""Soft-capping, `cap * tanh(x / cap)` (Gemma's attention scores and final logits), in place: the one formula of the
torch paths (engine/layers/cpu_attention.py's scores, engine/models/decoder.py's logits). The kernels apply it in
their own language: engine/cpu_kernels/decode_attention.cpp, engine/triton_kernels/paged_online_softmax.py."""

from __future__ import annotations

import torch


def soft_cap_(x: torch.Tensor, cap: float) -> torch.Tensor:
    """x = cap * tanh(x / cap), in place; returns x."""
    return x.div_(cap).tanh_().mul_(cap)
