"""LoRA shrink and expand (Punica's SGMV) over the step's adapter rows, beside their torch references.

The rows using an adapter come sorted by slot and cut into tiles of at most 16 rows of one adapter
(engine/lora/mapping.py `tiles`: slot, first index into `rows`, count). shrink: h[i] = x[rows[i]] @ A[slot].T
in float32 ([N, rank]); expand: y[rows[i]] += (h[i] @ B[slot].T) * scaling[slot], in place on y's columns.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.triton_kernels.paged_common import interpreter_dot_upcast

BLOCK_M = 16  # engine/lora/mapping.py TILE


def lora_shrink_ref(x: torch.Tensor, a: torch.Tensor, rows: torch.Tensor, tiles: torch.Tensor,
                    rank: int) -> torch.Tensor:
    """x [T, K], a [slots, R, K], rows [N] -> h [N, rank] float32."""
    h = torch.zeros(rows.shape[0], rank, dtype=torch.float32, device=x.device)
    for slot, start, n in tiles.tolist():
        idx = rows[start:start + n]
        h[start:start + n] = x[idx].float() @ a[slot, :rank].float().T
    return h


def lora_expand_ref(h: torch.Tensor, b: torch.Tensor, scaling: torch.Tensor, y: torch.Tensor, rows: torch.Tensor,
                    tiles: torch.Tensor) -> None:
    """h [N, rank] float32, b [slots, OUT, R], scaling [slots], y [T, OUT] (a column view is fine): y[rows] += ..."""
    rank = h.shape[1]
    for slot, start, n in tiles.tolist():
        idx = rows[start:start + n]
        delta = (h[start:start + n] @ b[slot, :, :rank].float().T) * scaling[slot]
        y[idx] = (y[idx].float() + delta).to(y.dtype)


@triton.jit
def _tile(rows_ptr, tiles_ptr, rank, BLOCK_R: tl.constexpr, BLOCK: tl.constexpr):
    """This program's tile: its adapter slot, its first row in the sorted order, the rows it holds (masked) and
    the rank's columns (masked)."""
    tile = tl.program_id(0)
    slot = tl.load(tiles_ptr + tile * 3).to(tl.int64)
    start = tl.load(tiles_ptr + tile * 3 + 1)
    count = tl.load(tiles_ptr + tile * 3 + 2)
    m = tl.arange(0, BLOCK)
    m_mask = m < count
    row = tl.load(rows_ptr + start + m, mask=m_mask, other=0)
    r = tl.arange(0, BLOCK_R)
    return slot, start, m, m_mask, row, r, r < rank


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, rows_ptr, tiles_ptr, h_ptr, K, rank, x_stride, a_slot_stride, a_row_stride,
                   h_stride, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK: tl.constexpr,
                   DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    slot, start, m, m_mask, row, r, r_mask = _tile(rows_ptr, tiles_ptr, rank, BLOCK_R, BLOCK)
    acc = tl.zeros((BLOCK, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        xt = tl.load(x_ptr + row[:, None] * x_stride + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        at = tl.load(a_ptr + slot * a_slot_stride + r[None, :] * a_row_stride + k[:, None],
                     mask=r_mask[None, :] & k_mask[:, None], other=0.0)
        xt = xt.to(at.dtype)
        if UPCAST:
            xt, at = xt.to(tl.float32), at.to(tl.float32)
        acc += tl.dot(xt, at, input_precision=DOT_PRECISION)
    out = h_ptr + (start + m)[:, None] * h_stride + r[None, :]
    tl.store(out, acc, mask=m_mask[:, None] & r_mask[None, :])


@triton.jit
def _expand_kernel(h_ptr, b_ptr, scale_ptr, y_ptr, rows_ptr, tiles_ptr, OUT, rank, h_stride, b_slot_stride,
                   b_row_stride, y_stride, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    col0 = tl.program_id(1) * BLOCK_N
    slot, start, m, m_mask, row, r, r_mask = _tile(rows_ptr, tiles_ptr, rank, BLOCK_R, BLOCK)
    n = col0 + tl.arange(0, BLOCK_N)
    n_mask = n < OUT
    ht = tl.load(h_ptr + (start + m)[:, None] * h_stride + r[None, :], mask=m_mask[:, None] & r_mask[None, :],
                 other=0.0)
    bt = tl.load(b_ptr + slot * b_slot_stride + n[None, :] * b_row_stride + r[:, None],
                 mask=r_mask[:, None] & n_mask[None, :], other=0.0).to(tl.float32)
    delta = tl.dot(ht, bt, input_precision=DOT_PRECISION) * tl.load(scale_ptr + slot)
    y = y_ptr + row[:, None] * y_stride + n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    old = tl.load(y, mask=mask, other=0.0)
    tl.store(y, (old.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=mask)


def _block_r(rank: int) -> int:
    return max(16, int(triton.next_power_of_2(rank)))


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def lora_shrink(x: torch.Tensor, a: torch.Tensor, rows: torch.Tensor, tiles: torch.Tensor, rank: int) -> torch.Tensor:
    """Triton version of lora_shrink_ref (x's rows and a's last dim must have unit stride)."""
    h = torch.empty(rows.shape[0], rank, dtype=torch.float32, device=x.device)
    if tiles.shape[0]:
        k = x.shape[1]
        _shrink_kernel[(tiles.shape[0],)](
            x, a, rows, tiles, h, k, rank, x.stride(0), a.stride(0), a.stride(1), h.stride(0),
            BLOCK_R=_block_r(rank), BLOCK_K=min(128, max(16, triton.next_power_of_2(k))), BLOCK=BLOCK_M,
            DOT_PRECISION=_precision(a.dtype), UPCAST=interpreter_dot_upcast(a.dtype))
    return h


def lora_expand(h: torch.Tensor, b: torch.Tensor, scaling: torch.Tensor, y: torch.Tensor, rows: torch.Tensor,
                tiles: torch.Tensor) -> None:
    """Triton version of lora_expand_ref: in place on y [T, OUT] (a column slice of the base's output)."""
    out = y.shape[1]
    if tiles.shape[0] and out:
        block_n = min(128, max(16, triton.next_power_of_2(out)))
        _expand_kernel[(tiles.shape[0], triton.cdiv(out, block_n))](
            h, b, scaling, y, rows, tiles, out, h.shape[1], h.stride(0), b.stride(0), b.stride(1), y.stride(0),
            BLOCK_R=_block_r(h.shape[1]), BLOCK_N=block_n, BLOCK=BLOCK_M, DOT_PRECISION=_precision(b.dtype))
