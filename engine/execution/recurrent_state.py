"""A hybrid model's recurrent state in memory, and each step's view of it.

`RecurrentStates` holds one tensor per (recurrent layer, state kind), [slots, ...] each; a sequence's slot
number comes from the block manager's pool (engine/core/state_pool.py). `step` makes the `StateBatch` the
mixers read: which slot each sequence of the flat batch uses, its single-token rows (batched: the state is
updated in place at those slots) and its longer chunks (one chunked form each, from its slot's state). A
sequence whose chunk starts at position 0 starts from a zeroed state: a new request, or one recomputing after
preemption.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from engine.config import EngineConfig
from engine.models.checkpoint_meta import ModelLoadError
from engine.models.recurrent.state import Chunk, StateBatch, StateShape, slot_bytes
from engine.types.sequence import ScheduledSeq, Sequence


class Slots(Protocol):
    """The block manager's state pool (engine/core/state_pool.py), as the runner reads it."""

    def slot(self, seq: Sequence) -> int: ...


class RecurrentStates:
    def __init__(self, shapes: list[list[StateShape]], num_slots: int, device: torch.device) -> None:
        """shapes: per recurrent layer, its state tensors' per-slot shapes (the model's `state_shapes`)."""
        self.num_slots = num_slots
        self.layers = [
            tuple(torch.zeros((num_slots, *shape), dtype=dtype, device=device) for shape, dtype in layer)
            for layer in shapes
        ]
        self.device = device
        self.slot_blocks = 1  # one slot's weight in KV blocks (the usage metric)
        self.pool: Slots | None = None  # the block manager's, set by the engine core

    def step(self, batch: list[ScheduledSeq]) -> StateBatch:
        """The step's view; zeroes the slots of sequences that start from their first token."""
        assert self.pool is not None, "the engine core links the block manager's state pool first"
        chunks: list[Chunk] = []
        rows: list[int] = []
        slots: list[int] = []
        fresh: list[int] = []
        row = 0
        for s in batch:
            slot = self.pool.slot(s.seq)
            if s.start == 0:
                fresh.append(slot)
            if s.num_new_tokens == 1:
                rows.append(row)
                slots.append(slot)
            else:
                chunks.append(Chunk(row, s.num_new_tokens, slot))
            row += s.num_new_tokens
        if fresh:
            index = torch.tensor(fresh, dtype=torch.long, device=self.device)
            for layer in self.layers:
                for t in layer:
                    t.index_fill_(0, index, 0)
        dev = self.device
        return StateBatch(
            self.layers,
            chunks,
            torch.tensor(rows, dtype=torch.long, device=dev) if rows else None,
            torch.tensor(slots, dtype=torch.long, device=dev) if slots else None,
        )


def slot_count(per_slot: int, kv_cache_memory: int, max_num_seqs: int, fixed_blocks: bool) -> int:
    """State slots: one per sequence that may run (--max-num-seqs), but at most half the KV budget's worth
    (sequences beyond wait for a slot as for blocks); with --num-blocks the pool comes on top."""
    if fixed_blocks:
        return max_num_seqs
    return max(1, min(max_num_seqs, kv_cache_memory // 2 // max(per_slot, 1)))


def make_states(
    model: object, config: EngineConfig, bytes_per_block: int, device: torch.device
) -> tuple[RecurrentStates | None, int]:
    """A hybrid model's state pool and the bytes it takes from --kv-cache-memory; (None, 0) for other models."""
    shapes_of = getattr(model, "state_shapes", None)
    if shapes_of is None:
        return None, 0
    if config.enable_lora:
        raise ModelLoadError("--enable-lora is not supported on hybrid recurrent models (LFM2, Qwen3.5); drop it")
    shapes: list[list[StateShape]] = shapes_of()
    per_slot = slot_bytes(shapes)
    slots = slot_count(per_slot, config.kv_cache_memory, config.max_num_seqs, config.num_blocks is not None)
    states = RecurrentStates(shapes, slots, device)
    states.slot_blocks = max(1, math.ceil(per_slot / bytes_per_block))
    return states, 0 if config.num_blocks is not None else slots * per_slot
