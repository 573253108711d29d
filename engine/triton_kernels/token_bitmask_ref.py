"""The torch reference of token_bitmask.py's kernel, without Triton: the CPU path and the tests use it."""

from __future__ import annotations

import math

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


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place: logits[rows[i], t] = -inf where bitmask[i] disallows t; columns past the mask too."""
    covered = min(logits.shape[1], bitmask.shape[1] * 32)
    allowed = unpack_bitmask(bitmask, covered)
    for i, r in enumerate(rows.tolist()):
        logits[r, :covered].masked_fill_(~allowed[i], -math.inf)
        logits[r, covered:] = -math.inf
