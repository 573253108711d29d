"""Applying a grammar's token bitmask to logits: -inf wherever the bit is 0.

Bitmask layout (llguidance's and xgrammar's): [rows, ceil(V / 32)] int32, bit j of word w = token 32w + j.
On CPU a plain-torch / numpy path (llguidance.torch.apply_token_bitmask_inplace is torch.compile'd: a
C++ build on CPU); on CUDA the Triton kernel in engine/kernels/token_bitmask.py.
"""

from __future__ import annotations

import math

import numpy as np
import torch

_SHIFTS: dict[torch.device, torch.Tensor] = {}


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, words] int32 -> [rows, vocab] bool (True: allowed); any device, plain torch."""
    dev = bitmask.device
    shifts = _SHIFTS.get(dev)
    if shifts is None:
        shifts = _SHIFTS[dev] = torch.arange(8, dtype=torch.uint8, device=dev)
    b = bitmask.contiguous().view(torch.uint8)  # little-endian: byte k of word w holds tokens 32w + 8k ..
    return ((b[:, :, None] >> shifts) & 1).view(bitmask.shape[0], -1)[:, :vocab].bool()


def allow_only(bitmask: torch.Tensor, row: int, token: int) -> None:
    """bitmask[row] allows `token` and nothing else."""
    bitmask[row] = 0
    word = 1 << (token & 31)
    bitmask[row, token >> 5] = word - (1 << 32) if word >= 1 << 31 else word  # bit 31 is the int32 sign


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place: logits[rows[i], t] = -inf where bitmask[i] disallows t; columns past the mask too."""
    covered = min(logits.shape[1], bitmask.shape[1] * 32)
    allowed = unpack_bitmask(bitmask, covered)
    for i, r in enumerate(rows.tolist()):
        logits[r, :covered].masked_fill_(~allowed[i], -math.inf)
        logits[r, covered:] = -math.inf


def apply_token_bitmask_cpu(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """apply_token_bitmask_ref for CPU tensors: numpy's unpackbits is ~20x faster than the shifts above."""
    covered = min(logits.shape[1], bitmask.shape[1] * 32)
    packed = np.invert(bitmask.contiguous().numpy().view(np.uint8))  # set bits now mark banned tokens
    banned = torch.from_numpy(np.unpackbits(packed, axis=1, bitorder="little").view(np.bool_))
    for i, r in enumerate(rows):
        logits[r, :covered].masked_fill_(banned[i, :covered], -math.inf)
        logits[r, covered:] = -math.inf


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Mask logits[rows[i]] with bitmask[i] in place; bitmask lives on the CPU (the matcher writes it)."""
    if not rows:
        return
    if logits.device.type == "cpu":
        apply_token_bitmask_cpu(logits, bitmask, rows)
        return
    from engine.kernels import apply_token_bitmask as kernel

    dev = logits.device
    kernel(logits, bitmask.to(dev, non_blocking=True), torch.tensor(rows, dtype=torch.long).to(dev, non_blocking=True))
