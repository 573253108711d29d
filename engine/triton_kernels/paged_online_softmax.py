"""The online-softmax step both paged-attention kernels run per block of keys (paged_decode_attention.py and
paged_prefill_attention.py): gather K/V through the block table, scale and cap the scores, mask, fold into the
running max, sum and output. One copy, so the two kernels cannot drift apart."""

import triton
import triton.language as tl


@triton.jit
def tanh(x):
    """tanh from exp, so one formula serves CUDA and the interpreter; e^(-2|x|) <= 1 never overflows."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x >= 0, t, -t)


@triton.jit
def online_start(ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """(acc, m, l) before any key, for ROWS query rows: output 0, running max -inf, running sum 0, in float32."""
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    return acc, tl.full([ROWS], float("-inf"), tl.float32), tl.zeros([ROWS], tl.float32)


@triton.jit
def attend_block(q, acc, m_i, l_i, kc_ptr, vc_ptr, bt_row_ptr, pos, p_mask, allowed, kvh, offs_d, d_mask,
                 c_stride_s, c_stride_h, block_size, scale, softcap,
                 DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, SOFTCAP: tl.constexpr):
    """(acc, m, l) after the keys at positions `pos` (p_mask: inside the range read; allowed: [rows, keys] each
    query row may see them). bt_row_ptr points at the sequence's block-table row."""
    blk = tl.load(bt_row_ptr + pos // block_size, mask=p_mask, other=0).to(tl.int64)
    kv_off = (blk * block_size + pos % block_size)[:, None] * c_stride_s + kvh * c_stride_h + offs_d[None, :]
    kv_mask = p_mask[:, None] & d_mask[None, :]
    k = tl.load(kc_ptr + kv_off, mask=kv_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
    if SOFTCAP:
        s = softcap * tanh(s / softcap)
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # A row with nothing visible yet keeps m = -inf; subtract 0 there instead of -inf (no NaN).
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_sub[:, None])
    alpha = tl.exp(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(vc_ptr + kv_off, mask=kv_mask, other=0.0)
    if UPCAST:
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i
