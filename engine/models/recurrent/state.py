"""What a recurrent mixer sees of the state each step: the per-slot tensors and where each sequence's rows are."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

StateShape = tuple[tuple[int, ...], torch.dtype]  # one state tensor's per-slot shape and dtype


@dataclass(frozen=True)
class Chunk:
    row: int  # first row in the flat batch
    n: int
    slot: int
    snap: int = -1  # after this chunk, copy the slot's state to this snapshot slot (-1: none)


@dataclass(frozen=True)
class StateBatch:
    layers: list[tuple[torch.Tensor, ...]]  # per recurrent layer (model order): its state tensors [slots, ...]
    chunks: list[Chunk]  # sequences running more than one token, in order (cut where snapshots are taken)
    decode_rows: torch.Tensor | None  # [B] rows of single-token sequences (None: there are none)
    decode_slots: torch.Tensor | None  # [B] their slots
    # a state tensor's id -> its snapshot tensor [snapshots, ...] (prefix caching, engine/core/state_pool.py)
    snapshot_of: dict[int, torch.Tensor] = field(default_factory=dict)

    def save(self, chunk: Chunk, state: torch.Tensor) -> None:
        """After a mixer ran `chunk`: keep its slot's state of `state` in the chunk's snapshot slot, if it has one."""
        if chunk.snap >= 0:
            self.snapshot_of[id(state)][chunk.snap] = state[chunk.slot]


def slot_bytes(shapes: list[list[StateShape]]) -> int:
    """Bytes of one slot: every recurrent layer's state tensors for one sequence."""
    return sum(math.prod(shape) * dtype.itemsize for layer in shapes for shape, dtype in layer)
