"""StatePool with the block manager: a slot per sequence taken with its first blocks and freed with them, waiting
when none is free; snapshots bound to the block ending at their point (taken before or after its registration),
prefix hits cut back to the last snapshot, dropped with their block, the least recently used evicted first (those at
branch points or restored from after the others); a prompt's last full block and the end of a match past the last
snapshot (a branch point) get snapshots of their own."""

from __future__ import annotations

import pytest

from engine.core.block_manager import BlockManager
from engine.core.state_pool import StatePool
from engine.messages import SamplingParams
from engine.types.sequence import Sequence

BS = 4


def seq(tokens: list[int], rid: str) -> Sequence:
    return Sequence.new(rid, tokens, SamplingParams(max_tokens=4), 0.0)


def compute(bm: BlockManager, pool: StatePool, s: Sequence, snapshot_first: bool = True) -> int:
    """Admit s with its usable hits and run its prompt in one step, snapshots taken as the runner does; its cached
    tokens. snapshot_first: the runner takes the snapshots before the blocks are registered (as in update)."""
    hits = bm.lookup(s)
    cached = len(hits) * BS
    assert bm.allocate(s, s.num_tokens - cached, hits)
    assert (pool.pop_restore(s) is not None) == (cached > 0)  # the runner fills the slot from the snapshot
    if not snapshot_first:
        bm.register_full_blocks(s, upto=s.num_tokens)  # admission registers the chunk's blocks before the step
    for p in pool.points(s, cached, s.num_tokens):
        pool.take_snapshot(s, p)
    s.num_computed_tokens = s.num_tokens
    bm.register_full_blocks(s)
    return cached


def test_slots_follow_blocks_and_a_sequence_waits_for_one() -> None:
    pool = StatePool(1)
    bm = BlockManager(16, BS, enable_prefix_caching=False, state=pool)
    a, b = seq(list(range(6)), "a"), seq(list(range(6)), "b")
    assert bm.allocate(a, 6) and pool.slot(a) == 0
    assert not bm.allocate(b, 6) and not b.block_table and bm.num_used_blocks == 2  # no slot: no blocks either
    assert bm.usage == (2 + 1, 16 + 1)
    bm.free(a)
    assert pool.num_used == 0 and bm.allocate(b, 6) and pool.slot(b) == 0


def test_prefix_caching_without_snapshots_is_refused() -> None:
    with pytest.raises(ValueError, match="without state snapshots"):
        BlockManager(16, BS, enable_prefix_caching=True, state=StatePool(2))


@pytest.mark.parametrize("snapshot_first", [True, False])
def test_hits_reach_the_last_snapshot(snapshot_first: bool) -> None:
    pool = StatePool(4, num_snapshots=8, interval=8)
    bm = BlockManager(64, BS, state=pool)
    shared = list(range(100, 121))  # 21 tokens: snapshots at 8 and 16
    assert compute(bm, pool, seq(shared + [1, 2, 3], "a"), snapshot_first) == 0
    assert pool.num_bound_snapshots == 3  # 8, 16 and 24 (a's own 24 tokens: its prompt's end)
    b = seq(shared + [7, 7, 7, 7, 7], "b")  # diverges at 21: blocks up to 20 hit, the snapshot at 16 is the last
    assert compute(bm, pool, b) == 16
    c = seq(shared[:10], "c")
    hits = bm.lookup(c)
    assert len(hits) * BS == 8 and bm.allocate(c, 2, hits) and pool.pop_restore(c) is not None


def test_snapshots_go_with_their_blocks_and_the_oldest_is_evicted() -> None:
    pool = StatePool(4, num_snapshots=1, interval=4)
    bm = BlockManager(8, BS, state=pool)
    a = seq(list(range(9)), "a")
    compute(bm, pool, a)  # points 4 and 8 in one step: the one snapshot slot goes to the first
    probe = seq(list(range(9)) + [5], "p")
    assert len(bm.lookup(probe)) == 1 and pool.num_bound_snapshots == 1
    pool.begin_step()
    d = seq(list(range(50, 55)), "d")
    compute(bm, pool, d)  # a later step's snapshot evicts a's, the least recently used
    assert bm.lookup(probe) == [] and pool.num_bound_snapshots == 1
    e = seq(list(range(50, 57)), "e")
    assert compute(bm, pool, e) == 4  # resumes from d's snapshot
    for done in (a, d, e):
        bm.free(done)
    big = seq(list(range(500, 532)), "big")
    assert bm.allocate(big, 32)  # every block, the cached ones evicted: their snapshot dropped with them
    assert pool.num_bound_snapshots == 0


def test_a_branch_point_keeps_its_snapshot_before_prompt_ends() -> None:
    """No periodic point in these prompts: a leaves one at its prompt's end (24); b matches a's blocks up to 20
    (no snapshot there: no hit) and leaves one at that branch point, where c resumes. Room for two: a new prompt
    end evicts the other prompt end, never the branch point."""
    pool = StatePool(8, num_snapshots=2, interval=64)
    bm = BlockManager(64, BS, state=pool)
    shared = list(range(100, 121))  # 21 tokens
    assert compute(bm, pool, seq(shared + [1, 2, 3], "a")) == 0
    assert compute(bm, pool, seq(shared + [7, 7, 7, 7, 7], "b")) == 0
    assert pool.num_bound_snapshots == 2  # b's branch point (20) and b's end (24); a's end evicted
    pool.begin_step()
    assert compute(bm, pool, seq(list(range(50, 59)), "d")) == 0  # its end (8) evicts b's, not the branch point
    assert compute(bm, pool, seq(shared + [9, 9, 9], "c")) == 20  # its end (24) evicts d's
    assert len(bm.lookup(seq(shared + [5, 5], "f"))) * BS == 20 and bm.lookup(seq(list(range(50, 59)), "g")) == []
