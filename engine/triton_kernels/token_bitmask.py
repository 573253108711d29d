"""A grammar's token bitmask applied to logits in place (constrained decoding, engine/structured/)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.triton_kernels.token_bitmask_ref import apply_token_bitmask_ref

__all__ = ["apply_token_bitmask", "apply_token_bitmask_ref"]

BLOCK = 1024  # columns per program: a multiple of 32, so one program reads whole bitmask words


@triton.jit
def _bitmask_kernel(logits_ptr, bitmask_ptr, rows_ptr, logits_stride, bitmask_stride, vocab, covered,
                    BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row = tl.load(rows_ptr + i).to(tl.int64)
    in_mask = cols < covered
    words = tl.load(bitmask_ptr + i * bitmask_stride + cols // 32, mask=in_mask, other=0)
    banned = ((words >> (cols % 32)) & 1) == 0  # arithmetic shift: bit 31 still lands in bit 0
    neg_inf = tl.full([BLOCK], float("-inf"), tl.float32).to(logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * logits_stride + cols, neg_inf, mask=banned & (cols < vocab))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Triton version of apply_token_bitmask_ref: logits [N, V] (unit column stride), bitmask [M, W] int32 and
    rows [M] int64 on logits' device; logits[rows[i]] is masked by bitmask[i]."""
    assert bitmask.dtype == torch.int32 and logits.stride(1) == 1
    m, vocab = rows.numel(), logits.shape[1]
    if m == 0 or vocab == 0:
        return
    covered = min(vocab, bitmask.shape[1] * 32)
    bitmask = bitmask.contiguous()
    _bitmask_kernel[(m, triton.cdiv(vocab, BLOCK))](logits, bitmask, rows, logits.stride(0), bitmask.stride(0),
                                                   vocab, covered, BLOCK=BLOCK, num_warps=4)
