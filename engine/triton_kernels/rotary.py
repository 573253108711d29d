"""Rotary position embedding, neox style (rotate_half, as HF Llama/Qwen2/Mistral), in place on q and k.

cos_sin_cache is [max_pos, rotary_dim] float32: cos in the first rotary_dim // 2 columns, sin in the rest
(the table engine/models/rope.py's rope_table builds). Dims past rotary_dim are left as they are.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    half = cos.shape[-1]
    x1, x2 = x[..., :half].float(), x[..., half:2 * half].float()
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    x[..., :2 * half] = out.to(x.dtype)


def rotary_embedding_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                         cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T], q [T, heads, D], k [T, kv_heads, D]; rotates q and k in place and returns them."""
    half = cos_sin_cache.shape[-1] // 2
    cs = cos_sin_cache[positions].float()
    cos, sin = cs[:, None, :half], cs[:, None, half:2 * half]
    _rotate_ref(q, cos, sin)
    _rotate_ref(k, cos, sin)
    return q, k


@triton.jit
def _rotate_heads(x_ptr, t, stride_t, stride_h, n_heads, cos, sin, offs_h, offs_d, HALF: tl.constexpr):
    # One token's heads [BLOCK_H, BLOCK_HALF]; rows past n_heads and columns past HALF are masked.
    mask = (offs_h[:, None] < n_heads) & (offs_d[None, :] < HALF)
    p1 = x_ptr + t * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(p1, (x1f * cos - x2f * sin).to(x1.dtype), mask=mask)
    tl.store(p1 + HALF, (x2f * cos + x1f * sin).to(x1.dtype), mask=mask)


@triton.jit
def _rotary_kernel(pos_ptr, q_ptr, k_ptr, cs_ptr, q_stride_t, q_stride_h, k_stride_t, k_stride_h, cs_stride,
                   n_q_heads, n_k_heads, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                   BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    dmask = offs_d < HALF
    cos = tl.load(cs_ptr + pos * cs_stride + offs_d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cs_ptr + pos * cs_stride + HALF + offs_d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(q_ptr, t, q_stride_t, q_stride_h, n_q_heads, cos, sin, tl.arange(0, BLOCK_HQ), offs_d, HALF)
    _rotate_heads(k_ptr, t, k_stride_t, k_stride_h, n_k_heads, cos, sin, tl.arange(0, BLOCK_HK), offs_d, HALF)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of rotary_embedding_ref. q and k may be strided views (e.g. of a fused qkv output)
    as long as their last dim has unit stride; they are updated in place."""
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1:
        raise ValueError("rotary_embedding needs unit stride on the head dim; pass .contiguous() tensors")
    rot = cos_sin_cache.shape[-1]
    if rot % 2 or rot > q.shape[-1]:
        raise ValueError(f"rotary_dim {rot} must be even and at most head_dim {q.shape[-1]}")
    t = q.shape[0]
    if t:
        half = rot // 2
        _rotary_kernel[(t,)](positions, q, k, cos_sin_cache, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                             cos_sin_cache.stride(0), q.shape[1], k.shape[1], HALF=half,
                             BLOCK_HALF=triton.next_power_of_2(half), BLOCK_HQ=triton.next_power_of_2(q.shape[1]),
                             BLOCK_HK=triton.next_power_of_2(k.shape[1]), num_warps=4)
    return q, k
