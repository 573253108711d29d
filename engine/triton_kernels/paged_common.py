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


def launch_caches(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_size: int | None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(flat K, flat V, block_size) for a kernel launch, checked: the kernels index q's head dim with unit stride and
    read K and V through one set of strides; each query head reads kv head h // (heads // kv_heads)."""
    kf, bs = flat_cache(k_cache, block_size)
    vf, _ = flat_cache(v_cache, block_size)
    if q.shape[1] % kf.shape[1] or q.stride(-1) != 1 or kf.stride() != vf.stride():
        raise ValueError("heads must be a multiple of kv heads; q needs a unit-stride head dim; "
                         "K and V caches must share one layout")
    return kf, vf, bs


def context_slots(block_table: torch.Tensor, seq_len: int, block_size: int, first: int = 0) -> torch.Tensor:
    """Slots of positions first..seq_len-1 of one sequence (int64); blocks before `first`'s are never read
    (a sliding window's block manager may have freed them)."""
    pos = torch.arange(first, seq_len, device=block_table.device)
    return block_table.long()[pos // block_size] * block_size + pos % block_size


def first_visible(q_first: int, sliding_window: int | None) -> int:
    """The first key position a query at q_first (the earliest of its chunk) can see."""
    return 0 if sliding_window is None else max(0, q_first - sliding_window + 1)


def soft_cap(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return scores if softcap is None else softcap * torch.tanh(scores / softcap)


def attend_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float,
               sliding_window: int | None, softcap: float | None = None, k_first: int = 0) -> torch.Tensor:
    """q [Lq, H, D] at positions q_pos [Lq] over k, v [L, kv_heads, D] at positions k_first.., in float32."""
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)  # query head h reads kv head h // group
    vf = v.float().repeat_interleave(group, dim=1)
    scores = soft_cap(torch.einsum("qhd,khd->hqk", q.float(), kf) * scale, softcap)
    k_pos = torch.arange(k_first, k_first + k.shape[0], device=q.device)
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


def softcap_arg(softcap: float | None) -> float:
    """The kernels' runtime softcap argument: 0.0 means none (their SOFTCAP constexpr is then False)."""
    if softcap is not None and softcap <= 0:
        raise ValueError(f"softcap must be positive, not {softcap}")
    return softcap or 0.0
