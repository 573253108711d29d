"""Scatter the step's new K/V into the paged cache by slot (slot -1: skip, a padding token)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _flat(cache: torch.Tensor) -> torch.Tensor:
    # [num_blocks, block_size, kv_heads, D] and [num_slots, kv_heads, D] address the same slots.
    return cache.view(-1, cache.shape[-2], cache.shape[-1])


def write_kv_cache_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """k, v [T, kv_heads, D] -> k_cache/v_cache slots slot_mapping [T] (int64; negative = skip)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    _flat(k_cache)[slots] = k[keep].to(k_cache.dtype)
    _flat(v_cache)[slots] = v[keep].to(v_cache.dtype)


@triton.jit
def _kv_write_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, k_stride_t, k_stride_h, v_stride_t, v_stride_h,
                     c_stride_s, c_stride_h, n_heads, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        offs_h = tl.arange(0, BLOCK_H)[:, None]
        offs_d = tl.arange(0, BLOCK_D)[None, :]
        mask = (offs_h < n_heads) & (offs_d < HEAD_DIM)
        dst = slot * c_stride_s + offs_h * c_stride_h + offs_d
        k = tl.load(k_ptr + t * k_stride_t + offs_h * k_stride_h + offs_d, mask=mask)
        tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=mask)
        v = tl.load(v_ptr + t * v_stride_t + offs_h * v_stride_h + offs_d, mask=mask)
        tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Triton version of write_kv_cache_ref; k and v may be strided views with a unit-stride head dim."""
    kc, vc = _flat(k_cache), _flat(v_cache)
    if k.stride(-1) != 1 or v.stride(-1) != 1 or kc.stride() != vc.stride():
        raise ValueError("write_kv_cache needs unit stride on the head dim and K/V caches of one layout")
    t, heads, d = k.shape
    if t:
        _kv_write_kernel[(t,)](k, v, kc, vc, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                               kc.stride(0), kc.stride(1), heads, HEAD_DIM=d,
                               BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(d),
                               num_warps=4)
