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
slot is then filled from that snapshot before its first chunk (`pop_restore`). Besides the periodic points, each
sequence has two points of its own (`points`): the end of its prompt's last full block (a later turn of a chat
resends the prompt) and, when its prompt matched cached blocks past the last snapshot, the end of that match (a
branch point: the next request sharing the prefix resumes there). Snapshots have a budget of their own
(`num_snapshots`), least recently used evicted first, but those never restored and not at a branch point before
any that were.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Protocol

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
        self._kept: set[int] = set()  # content ids whose snapshot proved shared: evicted after all others
        self._points: dict[Sequence, dict[int, bool]] = {}  # seq -> its own snapshot points -> kept when bound
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
        self._points.pop(seq, None)
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
    def usable_hits(self, seq: Sequence, num_hits: int, content_id: list[int], hits: list[int], bs: int) -> int:
        """How many of the leading prefix-cache hits may be taken: up to the last block whose end has a snapshot.
        Sets seq's own snapshot points: its prompt's last full block, and the end of the hits past that."""
        if not self.interval:
            return 0
        usable = next((j for j in range(num_hits, 0, -1) if content_id[hits[j - 1]] in self._bound), 0)
        points = {seq.num_prompt_tokens // bs * bs: False}
        if num_hits > usable:  # a prefix another request computed, with no state there yet: a branch point
            points[num_hits * bs] = True
        self._points[seq] = points
        return usable

    def is_point(self, seq: Sequence, position: int) -> bool:
        return bool(self.interval) and (position % self.interval == 0 or position in self._points.get(seq, {}))

    def points(self, seq: Sequence, start: int, end: int) -> list[int]:
        """seq's snapshot points in (start, end], in order."""
        if not self.interval:
            return []
        periodic = range((start // self.interval + 1) * self.interval, end + 1, self.interval)
        own = [p for p in self._points.get(seq, {}) if start < p <= end]
        return sorted(set(periodic).union(own))

    def restore_from(self, seq: Sequence, content_id: int) -> None:
        """seq took hits up to the block with this content id: its slot starts from that block's snapshot."""
        snap = self._bound[content_id]
        self._bound.move_to_end(content_id)
        self._kept.add(content_id)  # restored from: a prefix requests share
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
        if cid is not None and cid in self._bound:  # kept already (an n > 1 sibling's): marked as seq would
            self._mark(seq, position, cid)
            return None
        if not self._snap_free and not self._evict():
            return None
        snap = self._snap_free.pop()
        if cid is None:
            self._pending[seq, position] = snap
        else:
            self._keep(seq, position, cid, snap)
        return snap

    def _keep(self, seq: Sequence, position: int, cid: int, snap: int) -> None:
        self._bound[cid] = snap
        self._mark(seq, position, cid)

    def _mark(self, seq: Sequence, position: int, cid: int) -> None:
        """A snapshot at seq's branch point is evicted after the others."""
        if self._points.get(seq, {}).get(position, False):
            self._kept.add(cid)

    def _evict(self) -> bool:
        """Free one snapshot slot: the least recently used snapshot never restored and not at a branch point, else
        the least recently used one; False when none is held."""
        victim = next((cid for cid in self._bound if cid not in self._kept), next(iter(self._bound), None))
        if victim is None:
            return False
        self.drop(victim)
        return True

    def bind(self, seq: Sequence, position: int, content_id: int) -> None:
        """The block ending at `position` is registered under content_id: its snapshot, taken already or to be
        taken, is kept under it."""
        if not self.is_point(seq, position):
            return
        snap = self._pending.pop((seq, position), None)
        if snap is None:
            self._expect.setdefault(seq, {})[position] = content_id
        elif content_id in self._bound:  # another sequence's snapshot of the same prefix: keep one
            self._snap_free.append(snap)
            self._mark(seq, position, content_id)
        else:
            self._keep(seq, position, content_id, snap)

    def drop(self, content_id: int) -> None:
        """The registration under content_id was evicted: its KV is gone, so is its snapshot."""
        snap = self._bound.pop(content_id, None)
        self._kept.discard(content_id)
        if snap is not None:
            self._snap_free.append(snap)


class RunnerStates(Protocol):
    """The runner's state tensors (engine/execution/recurrent_state.py RecurrentStates), as the core links them."""

    num_slots: int
    slot_blocks: int
    num_snapshots: int
    interval: int
    pool: Any


def hybrid_pool(states: RunnerStates | None) -> StatePool | None:
    """The pool of a hybrid model's runner, linked to it; None for other models."""
    if states is None:
        return None
    pool = StatePool(states.num_slots, states.slot_blocks, states.num_snapshots, states.interval)
    states.pool = pool
    return pool
