"""Applying a grammar's token bitmask to logits: -inf wherever the bit is 0.

Bitmask layout (llguidance's and xgrammar's): [rows, ceil(V / 32)] int32, bit j of word w = token 32w + j.
On CPU a plain-torch / numpy path (llguidance.torch.apply_token_bitmask_inplace is torch.compile'd: a
C++ build on CPU); on CUDA the Triton kernel in engine/triton_kernels/token_bitmask.py.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from engine import triton_kernels

_LANES = np.arange(32, dtype=np.int64)
SPARSE_WORDS = 4  # a row with under 1/4 of its words non-zero is applied by keeping its allowed tokens


def allow_only(bitmask: torch.Tensor, row: int, token: int) -> None:
    """bitmask[row] allows `token` and nothing else."""
    bitmask[row] = 0
    word = 1 << (token & 31)
    bitmask[row, token >> 5] = word - (1 << 32) if word >= 1 << 31 else word  # bit 31 is the int32 sign


def apply_token_bitmask_cpu(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """engine/triton_kernels/token_bitmask_ref.py's apply_token_bitmask_ref for CPU tensors. A row whose mask allows
    few words (a structural position: `,` or `}` or digits) keeps its allowed logits and fills the rest; the
    others (inside a string, most tokens allowed) go through numpy's unpackbits, ~20x faster than the
    reference's shifts."""
    covered = min(logits.shape[1], bitmask.shape[1] * 32)
    words = bitmask.contiguous().numpy()
    dense: list[int] = []
    for i, r in enumerate(rows):
        nz = np.flatnonzero(words[i])
        if len(nz) * SPARSE_WORDS > words.shape[1] or logits.dtype != torch.float32:
            dense.append(i)
            continue
        bits = np.unpackbits(words[i, nz].view(np.uint8), bitorder="little").view(np.bool_).reshape(-1, 32)
        ids = (nz[:, None] * 32 + _LANES)[bits]
        ids = ids[ids < covered]
        row = logits[r].numpy()  # shares memory: numpy's indexing costs ~1 µs a call against torch's ~10
        keep = row[ids]
        row.fill(-np.inf)
        row[ids] = keep
    if not dense:
        return
    packed = np.invert(words[dense].view(np.uint8))  # set bits now mark banned tokens
    banned = torch.from_numpy(np.unpackbits(packed, axis=1, bitorder="little").view(np.bool_))
    for j, i in enumerate(dense):
        r = rows[i]
        logits[r, :covered].masked_fill_(banned[j, :covered], -math.inf)
        logits[r, covered:] = -math.inf


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Mask logits[rows[i]] with bitmask[i] in place; bitmask lives on the CPU (the matcher writes it)."""
    if not rows:
        return
    if logits.device.type == "cpu":
        apply_token_bitmask_cpu(logits, bitmask, rows)
        return
    dev = logits.device
    triton_kernels.apply_token_bitmask(
        logits, bitmask.to(dev, non_blocking=True), torch.tensor(rows, dtype=torch.long).to(dev, non_blocking=True)
    )
