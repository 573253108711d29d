"""A hybrid model's recurrent state in memory, and each step's view of it.

`RecurrentStates` holds one tensor per (recurrent layer, state kind), [slots, ...] each, and as many snapshot
tensors, [snapshots, ...]; a sequence's slot number and the snapshot slots come from the block manager's pool
(engine/core/state_pool.py). `step` makes the `StateBatch` the mixers read: which slot each sequence of the flat
batch uses, its single-token rows (batched: the state is updated in place at those slots) and its longer chunks
(the chunked forms, from its slot's state), cut where a snapshot is taken. A sequence whose chunk starts at
position 0 starts from a zeroed state (a new request, or one recomputing after preemption); one admitted with
prefix-cache hits starts from the snapshot at the end of its last hit.

Speculative decoding: a verification (a decode carrying k draft tokens) runs its k + 1 positions as k + 1 rounds of
the single-token recurrent forms (as plain decoding would), keeping the state after each of the first k at the
slot's speculation slots; `accept` then rolls the slot back to the state after the last accepted position.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Protocol

import torch

from engine.config import EngineConfig
from engine.models.checkpoint_meta import ModelLoadError
from engine.models.recurrent.state import Chunk, Round, StateBatch, StateShape, slot_bytes
from engine.spec_config import parse_spec_config
from engine.types.sequence import ScheduledSeq, Sequence


class Slots(Protocol):
    """The block manager's state pool (engine/core/state_pool.py), as the runner reads it."""

    interval: int

    def slot(self, seq: Sequence) -> int: ...

    def pop_restore(self, seq: Sequence) -> int | None: ...

    def begin_step(self) -> None: ...

    def take_snapshot(self, seq: Sequence, position: int) -> int | None: ...

    def is_point(self, seq: Sequence, position: int) -> bool: ...

    def points(self, seq: Sequence, start: int, end: int) -> list[int]: ...


class RecurrentStates:
    def __init__(
        self,
        shapes: list[list[StateShape]],
        num_slots: int,
        device: torch.device,
        num_snapshots: int = 0,
        spec_tokens: int = 0,
    ) -> None:
        """shapes: per recurrent layer, its state tensors' per-slot shapes (the model's `state_shapes`);
        spec_tokens: the most draft tokens a verification carries (each slot keeps as many per-position states)."""
        self.num_slots, self.num_snapshots, self.spec_tokens = num_slots, num_snapshots, spec_tokens
        self.layers = [_zeros(num_slots, layer, device) for layer in shapes]
        self.snapshots = [_zeros(num_snapshots, layer, device) for layer in shapes]
        self.spec = [_zeros(num_slots * spec_tokens, layer, device) for layer in shapes]
        self.snapshot_of = {id(t): s for lt, ls in zip(self.layers, self.snapshots) for t, s in zip(lt, ls)}
        self.spec_of = {id(t): s for lt, ls in zip(self.layers, self.spec) for t, s in zip(lt, ls)}
        self.device = device
        self.slot_blocks = 1  # one slot's weight in KV blocks (the usage metric)
        self.interval = 0  # tokens between snapshot points (0: none)
        self.pool: Slots | None = None  # the block manager's, set by the engine core
        self.decode_snaps: list[tuple[int, int]] = []  # (slot, snapshot slot) copied after the forward
        self.verifying: dict[Sequence, tuple[int, int, int]] = {}  # seq -> (slot, start, draft tokens) this step

    def step(self, batch: list[ScheduledSeq]) -> StateBatch:
        """The step's view: slots zeroed or filled from their snapshot first, snapshot slots taken."""
        pool = self.pool
        assert pool is not None, "the engine core links the block manager's state pool first"
        pool.begin_step()
        self._prepare(batch, pool)
        chunks: list[Chunk] = []
        singles: list[tuple[int, int]] = []  # (row, slot) of single-token sequences
        self.decode_snaps, self.verifying = [], {}
        row = 0
        for s in batch:
            slot, start, n = pool.slot(s.seq), s.start, s.num_new_tokens
            if s.num_draft:  # a verification: its positions run one round each, their states kept (`accept`)
                assert n == s.num_draft + 1 <= self.spec_tokens + 1, "a verification runs its draft and one more"
                self.verifying[s.seq] = (row, slot, s.num_draft)
            elif n == 1:
                singles.append((row, slot))
                if pool.is_point(s.seq, start + 1):
                    snap = pool.take_snapshot(s.seq, start + 1)
                    if snap is not None:
                        self.decode_snaps.append((slot, snap))
            else:
                chunks += self._pieces(s, row, slot, pool)
            row += n
        rounds = self._rounds(singles)
        rows = torch.cat([r.rows for r in rounds]) if rounds else None
        return StateBatch(self.layers, chunks, rounds, self.snapshot_of, self.spec_of, rows)

    def _rounds(self, singles: list[tuple[int, int]]) -> list[Round]:
        """Round 0: the decodes and each verification's first position; round j: each verification's position j,
        whose state is kept at speculation slot slot * spec_tokens + j unless it is the last."""
        rounds = []
        depth = max((k for _, _, k in self.verifying.values()), default=-1) + 1
        for j in range(max(depth, 1 if singles else 0)):
            members = list(singles) if j == 0 else []
            members += [(row + j, slot) for row, slot, k in self.verifying.values() if j <= k]
            kept = [slot for _, slot, k in self.verifying.values() if j < k]
            rows, slots = zip(*members)
            rounds.append(
                Round(
                    self._index(rows),
                    self._index(slots),
                    self._index(kept) if kept else None,
                    self._index([slot * self.spec_tokens + j for slot in kept]) if kept else None,
                )
            )
        return rounds

    def _index(self, values: Iterable[int]) -> torch.Tensor:
        return torch.tensor(list(values), dtype=torch.long, device=self.device)

    def _prepare(self, batch: list[ScheduledSeq], pool: Slots) -> None:
        """Zero the slots of sequences starting at position 0; fill those resuming from a snapshot."""
        fresh: list[int] = []
        for s in batch:
            slot = pool.slot(s.seq)
            if s.start == 0:
                fresh.append(slot)
            elif (snap := pool.pop_restore(s.seq)) is not None:
                self._copy(self.snapshots, snap, self.layers, slot)
        if fresh:
            index = torch.tensor(fresh, dtype=torch.long, device=self.device)
            for layer in self.layers:
                for t in layer:
                    t.index_fill_(0, index, 0)

    def _pieces(self, s: ScheduledSeq, row: int, slot: int, pool: Slots) -> list[Chunk]:
        """s's chunk, cut after each snapshot point it passes (each piece then saves the state at its end)."""
        start, end = s.start, s.start + s.num_new_tokens
        pieces, at = [], start
        for p in pool.points(s.seq, start, end):
            snap = pool.take_snapshot(s.seq, p)
            if snap is not None:
                pieces.append(Chunk(row + at - start, p - at, slot, snap))
                at = p
        if at < end:
            pieces.append(Chunk(row + at - start, end - at, slot))
        return pieces

    def finish(self) -> None:
        """After the forward: the snapshots of single-token sequences that reached a snapshot point."""
        for slot, snap in self.decode_snaps:
            self._copy(self.layers, slot, self.snapshots, snap)
        self.decode_snaps = []

    def accept(self, seq: Sequence, accepted: int) -> None:
        """seq's verification accepted this many draft tokens: its state is the one after its last accepted
        position (rolled back from the speculation slot that kept it); snapshot points it passed are saved."""
        pool, entry = self.pool, self.verifying.pop(seq, None)
        if entry is None or pool is None:
            return
        slot, k = entry[1], entry[2]
        start = seq.num_computed_tokens  # the verification ran positions start .. start + k
        for p in pool.points(seq, start, start + accepted + 1):
            if (snap := pool.take_snapshot(seq, p)) is not None:
                j = p - start - 1
                src, at = (self.layers, slot) if j == k else (self.spec, slot * self.spec_tokens + j)
                self._copy(src, at, self.snapshots, snap)
        if accepted < k:
            self._copy(self.spec, slot * self.spec_tokens + accepted, self.layers, slot)

    @staticmethod
    def _copy(src: list[tuple[torch.Tensor, ...]], at: int, dst: list[tuple[torch.Tensor, ...]], into: int) -> None:
        for ls, ld in zip(src, dst):
            for a, b in zip(ls, ld):
                b[into] = a[at]


def _zeros(n: int, layer: list[StateShape], device: torch.device) -> tuple[torch.Tensor, ...]:
    return tuple(torch.zeros((n, *shape), dtype=dtype, device=device) for shape, dtype in layer)


def slot_count(per_slot: int, kv_cache_memory: int, max_num_seqs: int, fixed_blocks: bool) -> int:
    """State slots: one per sequence that may run (--max-num-seqs), but at most half the KV budget's worth
    (sequences beyond wait for a slot as for blocks); with --num-blocks the pool comes on top."""
    if fixed_blocks:
        return max_num_seqs
    return max(1, min(max_num_seqs, kv_cache_memory // 2 // max(per_slot, 1)))


def snapshot_plan(config: EngineConfig, per_slot: int) -> tuple[int, int]:
    """(snapshots, interval in tokens): state_snapshot_memory (default an eighth of kv_cache_memory) over one slot's
    bytes, every state_snapshot_interval tokens rounded up to whole blocks; none without prefix caching."""
    bs = config.block_size
    interval = -(-config.state_snapshot_interval // bs) * bs
    memory = config.state_snapshot_memory if config.state_snapshot_memory is not None else config.kv_cache_memory // 8
    if not interval or not config.enable_prefix_caching or config.runner == "pooling":
        return 0, 0
    count = memory // max(per_slot, 1)
    return count, interval if count else 0


def make_states(
    model: object, config: EngineConfig, bytes_per_block: int, device: torch.device
) -> tuple[RecurrentStates | None, int]:
    """A hybrid model's state pool and the bytes it takes from --kv-cache-memory; (None, 0) for other models."""
    shapes_of = getattr(model, "state_shapes", None)
    if shapes_of is None:
        return None, 0
    if config.enable_lora:
        raise ModelLoadError("--enable-lora is not supported on hybrid recurrent models; drop it")
    shapes: list[list[StateShape]] = shapes_of()
    spec = parse_spec_config(config.speculative_config) if config.runner != "pooling" else None
    k = spec.num_speculative_tokens if spec is not None else 0
    per_slot = slot_bytes(shapes)
    per_seq = per_slot * (1 + k)  # a verification keeps the state after each of its draft positions
    slots = slot_count(per_seq, config.kv_cache_memory, config.max_num_seqs, config.num_blocks is not None)
    snapshots, interval = snapshot_plan(config, per_slot)
    states = RecurrentStates(shapes, slots, device, snapshots, k)
    states.slot_blocks, states.interval = max(1, math.ceil(per_seq / bytes_per_block)), interval
    return states, 0 if config.num_blocks is not None else slots * per_seq + snapshots * per_slot
