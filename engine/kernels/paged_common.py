"""What the paged-attention kernels share: reading the cache layout and gathering a context (for references)."""

from __future__ import annotations

import os

import torch


def flat_cache(cache: torch.Tensor, block_size: int | None) -> tuple[torch.Tensor, int]:
    """[num_blocks, block_size, kv_heads, D] or flat [num_slots, kv_heads, D] -> (flat view, block_size)."""
    if cache.dim() == 4:
        if block_size is not None and block_size != cache.shape[1]:
            raise ValueError(f"block_size {block_size} disagrees with the cache's {cache.shape[1]}")
        return cache.view(-1, cache.shape[2], cache.shape[3]), cache.shape[1]
    if cache.dim() != 3 or block_size is None:
        raise ValueError("pass the cache as [num_blocks, block_size, kv_heads, D], "
                         "or as [num_slots, kv_heads, D] together with block_size=")
    return cache, block_size


def context_slots(block_table: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """Slots of positions 0..seq_len-1 of one sequence (int64)."""
    pos = torch.arange(seq_len, device=block_table.device)
    return block_table.long()[pos // block_size] * block_size + pos % block_size


def attend_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float,
               sliding_window: int | None) -> torch.Tensor:
    """q [Lq, H, D] at positions q_pos [Lq] over k, v [L, kv_heads, D] at positions 0..L-1, in float32."""
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)  # query head h reads kv head h // group
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale
    k_pos = torch.arange(k.shape[0], device=q.device)
    allowed = k_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        allowed &= q_pos[:, None] - k_pos[None, :] < sliding_window
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, vf)


def interpreter_dot_upcast(dtype: torch.dtype) -> bool:
    """Triton 3.9's CPU interpreter multiplies bfloat16 dot operands as raw uint16 bits; upcast them there.

    Compiled kernels (CUDA) never take this branch: it is a constexpr that is False outside the interpreter.
    """
    return dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"
