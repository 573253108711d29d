"""Decode attention over the paged KV cache: one query token per sequence, split-K (flash-decoding) style.

Each program takes one (sequence, kv head, split): all query heads of that kv head (GQA) against one
slice of the context, so K/V are read once per kv head. With several splits a second kernel merges the
slices by their log-sum-exp; small batches then still fill the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.triton_kernels.paged_common import interpreter_dot_upcast, launch_caches, softcap_arg
from engine.triton_kernels.paged_online_softmax import attend_block, online_start
from engine.triton_kernels.paged_prefill_attention import paged_prefill_attention_ref

TARGET_PROGRAMS = 264  # about two waves on a 132-SM H100/H200
MIN_SPLIT_LEN = 256  # below this many keys per split the merge costs more than it saves


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                               block_size: int | None = None, sliding_window: int | None = None,
                               softcap: float | None = None) -> torch.Tensor:
    """q [B, heads, D]: sequence b's token at position seq_lens[b] - 1 attends to its context (or window): the
    prefill reference with one query row per sequence."""
    cu_seqlens_q = torch.arange(q.shape[0] + 1, device=q.device)
    return paged_prefill_attention_ref(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                                       block_size=block_size, sliding_window=sliding_window, softcap=softcap)


@triton.jit
def _decode_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, seq_lens_ptr, out_ptr, part_ptr, lse_ptr,
                   q_stride_b, q_stride_h, c_stride_s, c_stride_h, bt_stride, o_stride_b, o_stride_h,
                   scale, block_size, window, group, softcap,
                   NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                   SOFTCAP: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    start = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    split_len = tl.cdiv(tl.cdiv(seq_len - start, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = start + split * split_len
    hi = tl.minimum(lo + split_len, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kvh * group + offs_g
    g_mask = offs_g < group
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + b * q_stride_b + heads[:, None] * q_stride_h + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    acc, m_i, l_i = online_start(BLOCK_G, BLOCK_D)
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        p_mask = pos < hi
        acc, m_i, l_i = attend_block(q, acc, m_i, l_i, kc_ptr, vc_ptr, bt_ptr + b * bt_stride, pos, p_mask,
                                     p_mask[None, :], kvh, offs_d, d_mask, c_stride_s, c_stride_h, block_size, scale,
                                     softcap, DOT_PRECISION, UPCAST, SOFTCAP)
    l_safe = tl.where(l_i > 0, l_i, 1.0)  # an empty split: output 0 with weight exp(-inf) = 0
    out = acc / l_safe[:, None]
    o_mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + b * o_stride_b + heads[:, None] * o_stride_h + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        # part [B, H, NUM_SPLITS, HEAD_DIM] float32, lse [B, H, NUM_SPLITS], both contiguous.
        row = (b * group * tl.num_programs(1) + heads) * NUM_SPLITS + split
        tl.store(part_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=o_mask)
        tl.store(lse_ptr + row, tl.where(l_i > 0, m_i + tl.log(l_safe), float("-inf")), mask=g_mask)


@triton.jit
def _merge_kernel(part_ptr, lse_ptr, out_ptr, n_heads, o_stride_b, o_stride_h,
                  NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    row = (b * n_heads + h) * NUM_SPLITS + offs_s
    s_mask = offs_s < NUM_SPLITS
    lse = tl.load(lse_ptr + row, mask=s_mask, other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    # An empty context (a padding row, seq_len 0) has every lse at -inf: its output is 0, not NaN.
    w = tl.exp(lse - tl.where(lse_max == float("-inf"), 0.0, lse_max))
    part = tl.load(part_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
                   mask=s_mask[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    w_sum = tl.sum(w, axis=0)
    out = tl.sum(part * w[:, None], axis=0) / tl.where(w_sum > 0, w_sum, 1.0)
    tl.store(out_ptr + b * o_stride_b + h * o_stride_h + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


def decode_num_warps(block_d: int) -> int:
    # 8 warps keep the D=128 tiles in registers (ptxas counts: bench/README.md, "Triton kernels").
    return 8 if block_d >= 128 else 4


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int) -> int:
    """Enough splits to give the GPU ~TARGET_PROGRAMS programs, each split at least MIN_SPLIT_LEN keys."""
    want = -(-TARGET_PROGRAMS // max(num_seqs * num_kv_heads, 1))  # ceil division
    return max(1, min(want, max_seq_len // MIN_SPLIT_LEN, 32))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                           block_size: int | None = None, sliding_window: int | None = None,
                           softcap: float | None = None, num_splits: int | None = None, max_seq_len: int | None = None,
                           out: torch.Tensor | None = None, block_n: int = 32) -> torch.Tensor:
    """Triton version of paged_decode_attention_ref. block_tables int32 [B, max_blocks], seq_lens int32 [B]
    (context length including the query token; 0 marks a padding row, whose output is 0).
    max_seq_len only sizes the split (no device sync); it defaults to the block table's capacity."""
    kf, vf, bs = launch_caches(q, k_cache, v_cache, block_size)
    n_seqs, n_heads, d = q.shape
    n_kv = kf.shape[1]
    out = torch.empty_like(q) if out is None else out
    if n_seqs == 0:
        return out
    if num_splits is None:
        num_splits = choose_num_splits(n_seqs, n_kv, max_seq_len or block_tables.shape[1] * bs)
    group = n_heads // n_kv
    block_d = max(16, triton.next_power_of_2(d))  # tl.dot needs every dim >= 16
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    part = lse = out  # unused placeholders when there is one split
    if num_splits > 1:
        part = torch.empty(n_seqs, n_heads, num_splits, d, dtype=torch.float32, device=q.device)
        lse = torch.empty(n_seqs, n_heads, num_splits, dtype=torch.float32, device=q.device)
    _decode_kernel[(n_seqs, n_kv, num_splits)](
        q, kf, vf, block_tables, seq_lens, out, part, lse,
        q.stride(0), q.stride(1), kf.stride(0), kf.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        scale, bs, sliding_window or 0, group, softcap_arg(softcap),
        NUM_SPLITS=num_splits, HEAD_DIM=d, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
        BLOCK_D=block_d, DOT_PRECISION=precision, UPCAST=interpreter_dot_upcast(q.dtype),
        SOFTCAP=softcap is not None, num_warps=decode_num_warps(block_d))
    if num_splits > 1:
        _merge_kernel[(n_seqs, n_heads)](part, lse, out, n_heads, out.stride(0), out.stride(1),
                                         NUM_SPLITS=num_splits, HEAD_DIM=d,
                                         BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d)
    return out
