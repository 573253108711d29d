"""BlockManager: allocation, prefix-cache hits, LRU eviction, exactness of matches, no leaks."""

from __future__ import annotations

import random

from engine.core.block_manager import _ROOT, PASSED, BlockManager
from engine.messages import SamplingParams
from engine.types.sequence import Sequence

PARAMS = SamplingParams(max_tokens=16)


def new_seq(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence.new(rid, tokens, PARAMS, 0.0)


def prefill(bm: BlockManager, seq: Sequence) -> int:
    """What the scheduler does for a new sequence: match, allocate the rest, compute it all,
    then the sampled token is appended."""
    hits = bm.lookup(seq)
    cached = len(hits) * bm.block_size
    assert bm.allocate(seq, seq.num_tokens - cached, hits)
    seq.num_computed_tokens = seq.num_tokens
    seq.token_ids.append(-1)
    bm.register_full_blocks(seq)
    return cached


def cached_tokens(bm: BlockManager, tokens: list[int]) -> int:
    return len(bm.lookup(new_seq(tokens, "probe"))) * bm.block_size


def decode(bm: BlockManager, seq: Sequence, token: int) -> None:
    """One decode step: the last token's K/V is computed, a new token appended."""
    assert bm.allocate(seq, 1)
    seq.num_computed_tokens += 1
    seq.token_ids.append(token)
    bm.register_full_blocks(seq)


def test_repeated_512_token_prompt_is_served_from_cache() -> None:
    bm = BlockManager(num_blocks=100, block_size=16)
    prompt = [random.Random(0).randrange(50_000) for _ in range(512)]
    a, b = new_seq(prompt, "a"), new_seq(prompt, "b")
    assert prefill(bm, a) == 0
    assert prefill(bm, b) == 496  # 31 of 32 blocks: the last token is always computed
    assert bm.prefix_cache_hits == 496
    assert bm.prefix_cache_queries == 1024
    assert b.block_table[:31] == a.block_table[:31]
    assert b.block_table[31] != a.block_table[31]
    assert bm.num_used_blocks == 33  # the 31 shared blocks are counted once
    bm.free(a)
    assert bm.num_used_blocks == 32  # shared blocks are still held by b
    bm.free(b)
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 100
    c = new_seq(prompt, "c")  # after both finished: served from free-but-cached blocks
    assert prefill(bm, c) == 496


def test_prompt_of_exact_block_multiple_keeps_last_block_computed() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    prefill(bm, new_seq(list(range(8)), "a"))
    assert prefill(bm, new_seq(list(range(8)), "b")) == 4
    assert prefill(bm, new_seq(list(range(9)), "c")) == 8


def test_match_needs_the_whole_prefix_not_just_the_block() -> None:
    bm = BlockManager(num_blocks=20, block_size=4)
    prefill(bm, new_seq([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], "a"))
    # same second and third block, different first block: nothing may match
    assert prefill(bm, new_seq([0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], "b")) == 0
    # same first block, different second: only the first matches, the third does not
    assert prefill(bm, new_seq([1, 2, 3, 4, 0, 6, 7, 8, 9, 10, 11, 12, 13], "c")) == 4


def test_blocks_filled_by_decode_are_cached() -> None:
    bm = BlockManager(num_blocks=20, block_size=4)
    a = new_seq(list(range(10)), "a")
    prefill(bm, a)
    for t in range(100, 108):
        decode(bm, a, t)
    # a follow-up request whose prompt is a's prompt + output (chat history) shares all of it
    follow = new_seq(a.token_ids + [7, 7, 7], "b")
    assert len(a.token_ids) == 19 and a.num_computed_tokens == 18
    assert prefill(bm, follow) == 16


def test_lru_eviction_takes_least_recently_freed_tail_first() -> None:
    bm = BlockManager(num_blocks=6, block_size=4)
    a, b = new_seq(list(range(0, 9)), "a"), new_seq(list(range(100, 109)), "b")
    prefill(bm, a)
    prefill(bm, b)
    bm.free(a)  # a's two full blocks: cached, least recently freed
    bm.free(b)
    assert bm.num_free_blocks == 6 and bm.num_cached_blocks == 4
    # 3 blocks: the 2 never-cached blocks go first, then one eviction: a's tail block
    c = new_seq(list(range(200, 209)), "c")
    assert bm.allocate(c, 9)
    assert cached_tokens(bm, list(range(0, 9))) == 4  # a's head survived
    assert cached_tokens(bm, list(range(100, 109))) == 8  # b untouched


def test_hit_refreshes_a_block_in_lru_order() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    a, b = new_seq(list(range(0, 5)), "a"), new_seq(list(range(100, 105)), "b")
    prefill(bm, a)
    prefill(bm, b)
    bm.free(a)
    bm.free(b)
    a2 = new_seq(list(range(0, 5)), "a2")  # takes a's cached block again, then frees it last
    assert prefill(bm, a2) == 4
    bm.free(a2)
    c = new_seq(list(range(300, 311)), "c")  # needs 3 blocks: 2 plain + evicts b's (older)
    assert bm.allocate(c, 11)
    assert cached_tokens(bm, list(range(0, 5))) == 4
    assert cached_tokens(bm, list(range(100, 105))) == 0


def test_allocation_fails_without_side_effects_when_full() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    a = new_seq(list(range(12)), "a")
    assert bm.allocate(a, 12)
    b = new_seq(list(range(50, 58)), "b")
    assert not bm.allocate(b, 8)
    assert b.block_table == [] and bm.num_free_blocks == 1
    assert bm.allocate(b, 4)


def test_free_cached_hits_count_against_free_space() -> None:
    bm = BlockManager(num_blocks=3, block_size=4)
    a = new_seq(list(range(9)), "a")
    prefill(bm, a)  # 3 blocks, 2 cached once freed
    bm.free(a)
    b = new_seq(list(range(9)) + [1, 2, 3, 4], "b")  # hits 2 blocks, needs 2 more: 4 > 3
    hits = bm.lookup(b)
    assert len(hits) == 2
    assert not bm.allocate(b, b.num_tokens - 8, hits)
    assert bm.num_free_blocks == 3 and bm.num_cached_blocks == 2


def test_concurrent_duplicates_and_no_leaks() -> None:
    bm = BlockManager(num_blocks=64, block_size=4)
    rng = random.Random(1)
    seqs = []
    for i in range(12):  # shared prefixes of varied length, computed side by side
        prefix = list(range(rng.choice([0, 4, 8, 13])))
        seqs.append(new_seq(prefix + [rng.randrange(1000) for _ in range(rng.randrange(1, 9))], str(i)))
    for s in seqs:
        assert bm.allocate(s, s.num_tokens)  # no lookup: all compute their own copies
    for s in seqs:
        s.num_computed_tokens = s.num_tokens
        bm.register_full_blocks(s)
    for s in seqs:
        bm.free(s)
    assert bm.num_free_blocks == 64 and bm.num_used_blocks == 0
    assert prefill(bm, new_seq(list(range(13)) + [5], "x")) == 12


def test_disabled_prefix_caching_never_hits() -> None:
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    prefill(bm, new_seq(list(range(9)), "a"))
    assert prefill(bm, new_seq(list(range(9)), "b")) == 0
    assert bm.prefix_cache_queries == 0 and bm.num_cached_blocks == 0


def reset_prefix_cache(bm: BlockManager) -> None:
    """Forget every free cached block (held blocks stay registered): a cold cache without a new manager."""
    for b in bm._free_cached:
        key = bm._key[b]
        if key is not None:
            del bm._cache[key]
        bm._key[b], bm._cid[b] = None, _ROOT
        bm._free_plain.append(b)
    bm._free_cached.clear()


def test_reset_prefix_cache_forgets_free_blocks() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    a = new_seq(list(range(9)), "a")
    prefill(bm, a)
    bm.free(a)
    reset_prefix_cache(bm)
    assert bm.num_cached_blocks == 0 and bm.num_free_blocks == 10
    assert prefill(bm, new_seq(list(range(9)), "b")) == 0


def windowed_step(bm: BlockManager, seq: Sequence, n: int, token: int | None = None) -> None:
    """What the scheduler does with a window: allocate, compute n tokens, register, release passed blocks."""
    assert bm.allocate(seq, n)
    seq.num_computed_tokens += n
    if token is not None:
        seq.token_ids.append(token)
    bm.register_full_blocks(seq)
    bm.release_passed(seq)


def test_window_releases_passed_blocks_and_keeps_them_cached() -> None:
    bm = BlockManager(num_blocks=20, block_size=4, window=6)
    a = new_seq(list(range(30)), "a")
    windowed_step(bm, a, 9)  # computed 9: the next query (position 9) sees 4..9, block 0 is passed
    assert a.block_table[0] == PASSED and PASSED not in a.block_table[1:]
    windowed_step(bm, a, 21, token=99)  # computed 30: position 30 sees 25..30, blocks 0..5 passed
    assert a.block_table[:6] == [PASSED] * 6 and len(a.block_table) == 8
    assert bm.num_used_blocks == 2
    for t in range(40):  # a long generation holds a window's worth of blocks
        windowed_step(bm, a, 1, token=t)
        assert bm.num_used_blocks <= bm.most_blocks_held(a.num_tokens, 1) == 3
    # released blocks stay in the prefix cache: the same prompt hits all 7 full blocks of it
    assert cached_tokens(bm, list(range(30))) == 28
    bm.free(a)  # PASSED entries are skipped, nothing is released twice
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 20


def test_window_takes_only_the_hits_its_queries_read() -> None:
    bm = BlockManager(num_blocks=12, block_size=4, window=5)
    a = new_seq(list(range(33)), "a")
    windowed_step(bm, a, 33)
    bm.free(a)
    b = new_seq(list(range(33)) + [7], "b")
    hits = bm.lookup(b)
    assert len(hits) == 8  # 32 cached tokens; b computes from position 32, which sees 28..32
    free_before = bm.num_free_blocks
    assert bm.allocate(b, 2, hits)
    assert b.block_table[:7] == [PASSED] * 7 and b.block_table[7] == hits[7]
    assert bm.num_free_blocks == free_before - 2  # one hit taken out of the pool, one new block
    b.num_computed_tokens = 34
    bm.register_full_blocks(b)
    bm.release_passed(b)
    bm.free(b)
    assert bm.num_used_blocks == 0 and cached_tokens(bm, list(range(33))) == 32


def test_window_bounds_the_blocks_a_request_needs() -> None:
    assert BlockManager(8, 4).most_blocks_held(100, 16) == 25
    bm = BlockManager(8, 4, window=8)
    assert bm.most_blocks_held(100, 16) == 7  # (8 - 1 + 16) / 4 rounded up, plus a block straddling the start
    assert bm.most_blocks_held(10, 16) == 3  # short: all of it
    rng = random.Random(5)
    for _ in range(200):  # the bound holds at every step of random chunkings
        window, bs, chunk = rng.randint(1, 12), rng.randint(1, 6), rng.randint(1, 10)
        bm = BlockManager(200, bs, window=window)
        seq = new_seq(list(range(60)), "s")
        while seq.num_computed_tokens < 60:
            n = min(rng.randint(1, chunk), 60 - seq.num_computed_tokens)
            assert bm.allocate(seq, n)
            assert bm.num_used_blocks <= bm.most_blocks_held(60, chunk)
            seq.num_computed_tokens += n
            bm.register_full_blocks(seq)
            bm.release_passed(seq)
