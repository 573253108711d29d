"""Prefill / extend attention over the paged KV cache for a ragged batch of query chunks.

Sequence b's queries are rows cu_seqlens_q[b]:cu_seqlens_q[b+1] of q; its chunk sits at the end of its
context of seq_lens[b] tokens, so the first seq_lens[b] - q_len positions are a cached prefix (prefix
caching, chunked prefill). The chunk's own K/V must already be in the cache. Causal within the chunk.
A chunk of one token is a decode step, so one launch can serve a mixed batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.triton_kernels.paged_common import (
    attend_ref,
    context_slots,
    first_visible,
    flat_cache,
    interpreter_dot_upcast,
    launch_caches,
    softcap_arg,
)
from engine.triton_kernels.paged_online_softmax import attend_block, online_start


def paged_prefill_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                                scale: float, *, block_size: int | None = None,
                                sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """q [T, heads, D] -> [T, heads, D]; cu_seqlens_q int32 [B + 1], seq_lens int32 [B]."""
    kf, bs = flat_cache(k_cache, block_size)
    vf, _ = flat_cache(v_cache, block_size)
    out = torch.empty_like(q)
    for b in range(seq_lens.shape[0]):
        q0, q1, n = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]), int(seq_lens[b])
        first = first_visible(n - (q1 - q0), sliding_window)
        slots = context_slots(block_tables[b], n, bs, first)
        q_pos = torch.arange(n - (q1 - q0), n, device=q.device)
        out[q0:q1] = attend_ref(q[q0:q1], kf[slots], vf[slots], q_pos, scale, sliding_window, softcap,
                                first).to(q.dtype)
    return out


@triton.jit
def _prefill_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, cu_q_ptr, seq_lens_ptr, out_ptr,
                    q_stride_t, q_stride_h, c_stride_s, c_stride_h, bt_stride, o_stride_t, o_stride_h,
                    scale, block_size, window, group, softcap,
                    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, SOFTCAP: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    m0 = tl.program_id(2) * BLOCK_M
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    if m0 < q_len:
        seq_len = tl.load(seq_lens_ptr + b)
        prefix = seq_len - q_len
        kvh = h // group
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        m_mask = offs_m < q_len
        d_mask = offs_d < HEAD_DIM
        q_pos = prefix + offs_m
        rows = (q_start + offs_m).to(tl.int64)
        q = tl.load(q_ptr + rows[:, None] * q_stride_t + h * q_stride_h + offs_d[None, :],
                    mask=m_mask[:, None] & d_mask[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        # Keys this tile can see: causal up to its last query; with a window, from its first query's reach.
        hi = tl.minimum(prefix + m0 + BLOCK_M, seq_len)
        lo = tl.where(window > 0, tl.maximum(prefix + m0 - window + 1, 0), 0)
        acc, m_i, l_i = online_start(BLOCK_M, BLOCK_D)
        for n0 in range(lo, hi, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            p_mask = pos < hi
            allowed = p_mask[None, :] & (pos[None, :] <= q_pos[:, None])
            allowed = allowed & ((window <= 0) | (q_pos[:, None] - pos[None, :] < window))
            acc, m_i, l_i = attend_block(q, acc, m_i, l_i, kc_ptr, vc_ptr, bt_ptr + b * bt_stride, pos, p_mask,
                                         allowed, kvh, offs_d, d_mask, c_stride_s, c_stride_h, block_size, scale,
                                         softcap, DOT_PRECISION, UPCAST, SOFTCAP)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + rows[:, None] * o_stride_t + h * o_stride_h + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def prefill_num_warps(block_m: int, block_d: int, elem_bytes: int) -> int:
    # 64x128 bf16 tiles spill at 4 warps and fit in registers at 8 (ptxas counts: bench/README.md, "Triton kernels").
    return 8 if block_m * block_d * elem_bytes >= 64 * 128 * 2 else 4


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                            scale: float, *, max_query_len: int, block_size: int | None = None,
                            sliding_window: int | None = None, softcap: float | None = None,
                            out: torch.Tensor | None = None,
                            block_m: int = 64, block_n: int = 32) -> torch.Tensor:
    """Triton version of paged_prefill_attention_ref. max_query_len (a host int the scheduler knows)
    sizes the grid, so the launch needs no device sync."""
    kf, vf, bs = launch_caches(q, k_cache, v_cache, block_size)
    t, n_heads, d = q.shape
    n_kv = kf.shape[1]
    out = torch.empty_like(q) if out is None else out
    n_seqs = seq_lens.shape[0]
    if t == 0 or n_seqs == 0:
        return out
    # Tiles no bigger than the longest chunk: decode-heavy batches do not pay for 64-row tiles.
    block_m = max(16, min(block_m, triton.next_power_of_2(max_query_len)))
    block_d = max(16, triton.next_power_of_2(d))  # tl.dot needs every dim >= 16
    grid = (n_seqs, n_heads, triton.cdiv(max_query_len, block_m))
    _prefill_kernel[grid](
        q, kf, vf, block_tables, cu_seqlens_q, seq_lens, out,
        q.stride(0), q.stride(1), kf.stride(0), kf.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        scale, bs, sliding_window or 0, n_heads // n_kv, softcap_arg(softcap),
        HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", UPCAST=interpreter_dot_upcast(q.dtype),
        SOFTCAP=softcap is not None, num_warps=prefill_num_warps(block_m, block_d, q.element_size()))
    return out
