"""Rotary tables: plain rope and the scaled variants current checkpoints use (linear, llama3, yarn, longrope).

Each computes what transformers' ROPE_INIT_FUNCTIONS do: inverse frequencies over the rotary dims and an
attention factor that scales cos and sin (yarn, longrope). The table is [positions, rotary_dim] float32,
cos in the first half and sin in the second, as `engine.layers.ops.apply_rope` and the Triton kernel read it.

longrope picks its short or long factors once per model, as vLLM does: long when the served length
(max_positions) exceeds original_max_position_embeddings. transformers switches per forward call on the
longest position, so the two agree on prompts past the original length and on every prompt of a model
served within it.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

SCALINGS = ("linear", "llama3", "yarn", "longrope")
log = logging.getLogger("engine")


def _base(dim: int, theta: float) -> torch.Tensor:
    """theta ** (2i / dim) for i < dim / 2, as transformers rounds it."""
    return theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)


def _llama3(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor = float(s["factor"])
    low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _yarn(dim: int, theta: float, s: dict[str, Any], max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    orig = int(s["original_max_position_embeddings"])
    factor = float(s.get("factor") or max_position_embeddings / orig)
    attention = s.get("attention_factor")
    if attention is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attention = _mscale(factor, m) / _mscale(factor, m_all) if m and m_all else _mscale(factor)
    beta_fast, beta_slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


def _longrope(
    dim: int, theta: float, s: dict[str, Any], max_position_embeddings: int, max_positions: int
) -> tuple[torch.Tensor, float]:
    orig = int(s["original_max_position_embeddings"])
    factor = float(s.get("factor") or max_position_embeddings / orig)
    attention = s.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    ext = s["long_factor"] if max_positions > orig else s["short_factor"]
    if max_positions > orig:  # said once per load: shorter sequences then differ from transformers (short factors)
        log.warning(
            "longrope: long factors for every sequence, since max_model_len %d > "
            "original_max_position_embeddings %d (as vLLM); --max-model-len %d keeps the short factors",
            max_positions,
            orig,
            orig,
        )
    if len(ext) != dim // 2:
        raise ValueError(f"rope_scaling long_factor/short_factor need {dim // 2} values, got {len(ext)}")
    return 1.0 / (torch.tensor(ext, dtype=torch.float32) * _base(dim, theta)), float(attention)


def inv_freq(
    dim: int, theta: float, scaling: dict[str, Any] | None, *, max_positions: int, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim // 2], attention factor) for `dim` rotary dims."""
    rope_type = (scaling or {}).get("rope_type", "default")
    if scaling is None or rope_type == "default":
        return 1.0 / _base(dim, theta), 1.0
    if rope_type == "linear":
        return 1.0 / _base(dim, theta) / float(scaling["factor"]), 1.0
    if rope_type == "llama3":
        return _llama3(1.0 / _base(dim, theta), scaling), 1.0
    if rope_type == "yarn":
        return _yarn(dim, theta, scaling, max_position_embeddings)
    if rope_type == "longrope":
        return _longrope(dim, theta, scaling, max_position_embeddings, max_positions)
    raise ValueError(f"rope_type {rope_type!r} is not supported; supported: default, {', '.join(SCALINGS)}")


def rope_table(
    dim: int, theta: float, scaling: dict[str, Any] | None, max_positions: int, max_position_embeddings: int
) -> torch.Tensor:
    """[max_positions, dim] float32: cos then sin of each position's angles, times the attention factor."""
    freq, attention = inv_freq(
        dim, theta, scaling, max_positions=max_positions, max_position_embeddings=max_position_embeddings
    )
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), freq)
    return torch.cat([angles.cos() * attention, angles.sin() * attention], dim=-1)
