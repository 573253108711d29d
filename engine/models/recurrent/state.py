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
class Round:
    """Single-token rows run together by the recurrent forms, their states updated in place at their slots: a
    step's decodes, and position j of every verification (a decode carrying draft tokens, one round per position)."""

    rows: torch.Tensor  # [B] rows of the flat batch
    slots: torch.Tensor  # [B] their slots
    # after the round: the states of these slots are kept at these speculation slots (a verification's position j)
    keep_slots: torch.Tensor | None = None
    keep_into: torch.Tensor | None = None


@dataclass(frozen=True)
class StateBatch:
    layers: list[tuple[torch.Tensor, ...]]  # per recurrent layer (model order): its state tensors [slots, ...]
    chunks: list[Chunk]  # sequences running more than one token, in order (cut where snapshots are taken)
    rounds: list[Round]  # single-token rows, round after round
    # a state tensor's id -> its snapshot tensor [snapshots, ...] (prefix caching, engine/core/state_pool.py)
    snapshot_of: dict[int, torch.Tensor] = field(default_factory=dict)
    # a state tensor's id -> its speculation tensor [slots * draft tokens, ...] (per-position states of a verification)
    spec_of: dict[int, torch.Tensor] = field(default_factory=dict)
    single_rows: torch.Tensor | None = None  # every round's rows (None: there are none)

    def save(self, chunk: Chunk, state: torch.Tensor) -> None:
        """After a mixer ran `chunk`: keep its slot's state of `state` in the chunk's snapshot slot, if it has one."""
        if chunk.snap >= 0:
            self.snapshot_of[id(state)][chunk.snap] = state[chunk.slot]

    def keep(self, rnd: Round, state: torch.Tensor) -> None:
        """After a mixer ran `rnd`: keep the verifications' states of `state` at their speculation slots."""
        if rnd.keep_slots is not None and rnd.keep_into is not None:
            self.spec_of[id(state)][rnd.keep_into] = state[rnd.keep_slots]


def slot_bytes(shapes: list[list[StateShape]]) -> int:
    """Bytes of one slot: every recurrent layer's state tensors for one sequence."""
    return sum(math.prod(shape) * dtype.itemsize for layer in shapes for shape, dtype in layer)
