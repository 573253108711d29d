"""Slots of per-sequence recurrent state beside the paged KV cache (hybrid models: LFM2, Qwen3.5, Granite 4.0-H),
and snapshots of that state at block-aligned prefix points for prefix caching.

A slot holds every recurrent layer's state for one sequence (conv windows, delta-rule and SSM matrices); the
tensors live in the runner (engine/execution/recurrent_state.py), this pool only hands slot numbers out. The block
manager takes a slot when a sequence takes its first blocks and gives it back whenever it frees them (finish,
abort, preemption), so the scheduler's admission, preemption and abort paths treat the state exactly as KV. A
slot's bytes come out of the KV budget; `slot_blocks` is what one slot weighs in KV blocks, for the usage metric.

Snapshots: every `interval` tokens the runner copies a sequence's state into a snapshot slot (`take_snapshot`);
when the block manager registers the block ending there, the snapshot is bound to that block's content id
(`bind`), and dropped when that registration is evicted (`drop`). A prefix-cache hit is cut back to the last
block whose end has a snapshot (`usable_hits`): KV is never restored without its state. The admitted sequence's
slot is then filled from that snapshot before its first chunk (`pop_restore`). Snapshots have a budget of their
own (`num_snapshots`), least recently used evicted first.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Protocol

from engine.models.checkpoint_meta import ModelLoadError
from engine.types.sequence import Sequence


class StatePool:
    def __init__(self, num_slots: int, slot_blocks: int = 1, num_snapshots: int = 0, interval: int = 0) -> None:
        if num_slots < 1:
            raise ValueError(f"a state pool needs at least one slot, not {num_slots}")
        self.num_slots = num_slots
        self.slot_blocks = max(1, slot_blocks)
        self._free = list(range(num_slots - 1, -1, -1))  # a stack: the lowest slot first
        self._held: dict[Sequence, int] = {}
        self.interval = interval if num_snapshots > 0 else 0  # tokens between snapshot points; 0: none
        self.num_snapshots = num_snapshots
        self._snap_free = list(range(num_snapshots - 1, -1, -1))
        self._bound: OrderedDict[int, int] = OrderedDict()  # content id -> snapshot slot, least recently used first
        self._pending: dict[tuple[Sequence, int], int] = {}  # (seq, position) -> snapshot slot, not bound yet
        # seq -> position -> content id of the block ending there, registered before its snapshot was taken (a
        # chunk's blocks are registered at admission, so that siblings admitted in the same step share them)
        self._expect: dict[Sequence, dict[int, int]] = {}
        self._restore: dict[Sequence, int] = {}  # seq -> snapshot slot its slot is filled from before it runs

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._held)

    @property
    def num_bound_snapshots(self) -> int:
        return len(self._bound)

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
        self._restore.pop(seq, None)
        self._expect.pop(seq, None)
        for key in [k for k in self._pending if k[0] is seq]:
            self._snap_free.append(self._pending.pop(key))
        slot = self._held.pop(seq, None)
        if slot is not None:
            self._free.append(slot)

    def slot(self, seq: Sequence) -> int:
        """seq's slot; KeyError when it holds none (a scheduled sequence always does)."""
        return self._held[seq]

    # ---- snapshots ----------------------------------------------------------------------------
    def usable_hits(self, num_hits: int, content_id: list[int], hits: list[int], block_size: int) -> int:
        """How many of the leading prefix-cache hits may be taken: up to the last block whose end has a snapshot."""
        for j in range(num_hits, 0, -1):
            if self.interval and j * block_size % self.interval == 0 and content_id[hits[j - 1]] in self._bound:
                return j
        return 0

    def restore_from(self, seq: Sequence, content_id: int) -> None:
        """seq took hits up to the block with this content id: its slot starts from that block's snapshot."""
        snap = self._bound[content_id]
        self._bound.move_to_end(content_id)
        self._restore[seq] = snap

    def pop_restore(self, seq: Sequence) -> int | None:
        return self._restore.pop(seq, None)

    def begin_step(self) -> None:
        """Snapshots taken but never bound (their block was not registered) go back to the free list."""
        self._snap_free.extend(self._pending.values())
        self._pending.clear()

    def take_snapshot(self, seq: Sequence, position: int) -> int | None:
        """A snapshot slot for seq's state after `position` tokens (the least recently used one evicted when
        none is free); None when snapshots are off, every snapshot slot is in use this step, or that prefix's
        snapshot is kept already. The runner writes it in this step's forward."""
        if not self.interval:
            return None
        cid = self._expect.get(seq, {}).pop(position, None)
        if cid is not None and cid in self._bound:
            return None
        if not self._snap_free:
            if not self._bound:
                return None
            self._snap_free.append(self._bound.popitem(last=False)[1])
        snap = self._snap_free.pop()
        if cid is None:
            self._pending[seq, position] = snap
        else:
            self._bound[cid] = snap
        return snap

    def bind(self, seq: Sequence, position: int, content_id: int) -> None:
        """The block ending at `position` is registered under content_id: its snapshot, taken already or to be
        taken, is kept under it."""
        if not self.interval or position % self.interval:
            return
        snap = self._pending.pop((seq, position), None)
        if snap is None:
            self._expect.setdefault(seq, {})[position] = content_id
        elif content_id in self._bound:  # another sequence's snapshot of the same prefix: keep one
            self._snap_free.append(snap)
        else:
            self._bound[content_id] = snap

    def drop(self, content_id: int) -> None:
        """The registration under content_id was evicted: its KV is gone, so is its snapshot."""
        snap = self._bound.pop(content_id, None)
        if snap is not None:
            self._snap_free.append(snap)


class RunnerStates(Protocol):
    """The runner's state tensors (engine/execution/recurrent_state.py RecurrentStates), as the core links them."""

    num_slots: int
    slot_blocks: int
    num_snapshots: int
    interval: int
    pool: Any


def hybrid_pool(states: RunnerStates | None, speculative_config: object) -> StatePool | None:
    """The pool of a hybrid model's runner, linked to it; None for other models. Speculative decoding is refused
    (ModelLoadError): a rejected draft token would leave its update in the state, which has no rollback here."""
    if states is None:
        return None
    if speculative_config:
        raise ModelLoadError(
            "--speculative-config is not supported on hybrid recurrent models (LFM2, Qwen3.5, Granite 4.0-H): "
            "their recurrent state cannot be rolled back past rejected draft tokens; drop it"
        )
    pool = StatePool(states.num_slots, states.slot_blocks, states.num_snapshots, states.interval)
    states.pool = pool
    return pool
