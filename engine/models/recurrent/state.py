"""What a recurrent mixer sees of the state each step: the per-slot tensors and where each sequence's rows are."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

StateShape = tuple[tuple[int, ...], torch.dtype]  # one state tensor's per-slot shape and dtype


@dataclass(frozen=True)
class Chunk:
    row: int  # first row in the flat batch
    n: int
    slot: int


@dataclass(frozen=True)
class StateBatch:
    layers: list[tuple[torch.Tensor, ...]]  # per recurrent layer (model order): its state tensors [slots, ...]
    chunks: list[Chunk]  # sequences running more than one token
    decode_rows: torch.Tensor | None  # [B] rows of single-token sequences (None: there are none)
    decode_slots: torch.Tensor | None  # [B] their slots


def slot_bytes(shapes: list[list[StateShape]]) -> int:
    """Bytes of one slot: every recurrent layer's state tensors for one sequence."""
    return sum(math.prod(shape) * dtype.itemsize for layer in shapes for shape, dtype in layer)
