"""Slots of per-sequence recurrent state beside the paged KV cache (hybrid models: LFM2, Qwen3.5).

A slot holds every recurrent layer's state for one sequence (conv windows, delta-rule matrices); the tensors
live in the runner (engine/execution/recurrent_state.py), this pool only hands slot numbers out. The block
manager takes a slot when a sequence takes its first blocks and gives it back whenever it frees them (finish,
abort, preemption), so the scheduler's admission, preemption and abort paths treat the state exactly as KV.
A slot's bytes come out of the KV budget; `slot_blocks` is what one slot weighs in KV blocks, for the usage
metric.
"""

from __future__ import annotations

from typing import Any, Protocol

from engine.models.checkpoint_meta import ModelLoadError
from engine.types.sequence import Sequence


class StatePool:
    def __init__(self, num_slots: int, slot_blocks: int = 1) -> None:
        if num_slots < 1:
            raise ValueError(f"a state pool needs at least one slot, not {num_slots}")
        self.num_slots = num_slots
        self.slot_blocks = max(1, slot_blocks)
        self._free = list(range(num_slots - 1, -1, -1))  # a stack: the lowest slot first
        self._held: dict[Sequence, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._held)

    def holds(self, seq: Sequence) -> bool:
        return seq in self._held

    def take(self, seq: Sequence) -> bool:
        """Give seq a slot (False, and no change, when none is free); a sequence holding one keeps it."""
        if seq in self._held:
            return True
        if not self._free:
            return False
        self._held[seq] = self._free.pop()
        return True

    def release(self, seq: Sequence) -> None:
        slot = self._held.pop(seq, None)
        if slot is not None:
            self._free.append(slot)

    def slot(self, seq: Sequence) -> int:
        """seq's slot; KeyError when it holds none (a scheduled sequence always does)."""
        return self._held[seq]


class RunnerStates(Protocol):
    """The runner's state tensors (engine/execution/recurrent_state.py RecurrentStates), as the core links them."""

    num_slots: int
    slot_blocks: int
    pool: Any


def hybrid_pool(states: RunnerStates | None, speculative_config: object) -> StatePool | None:
    """The pool of a hybrid model's runner, linked to it; None for other models. Speculative decoding is refused
    (ModelLoadError): a rejected draft token would leave its update in the state, which has no rollback here."""
    if states is None:
        return None
    if speculative_config:
        raise ModelLoadError(
            "--speculative-config is not supported on hybrid recurrent models (LFM2, Qwen3.5): their "
            "recurrent state cannot be rolled back past rejected draft tokens; drop it"
        )
    pool = StatePool(states.num_slots, states.slot_blocks)
    states.pool = pool
    return pool
