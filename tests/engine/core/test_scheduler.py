"""Scheduler: continuous batching, chunked prefill, preemption, priorities, aborts.

The engine loop is simulated with a fake model that WRITES each computed token into a fake
KV cache at its block/slot and, before sampling, READS back every position the sequence
attends to: a wrong block table, a bad prefix-cache hit or a broken recompute shows up as a
read that does not match the sequence's tokens.
"""

from __future__ import annotations

import random

import pytest

from engine.core.block_manager import BlockManager
from engine.core.scheduler import RequestRefused, Scheduler
from engine.messages import SamplingParams
from engine.types.sequence import ScheduledSeq, SeqStatus, Sequence


class FakeEngine:
    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int = 4,
        max_num_seqs: int = 8,
        max_num_batched_tokens: int = 32,
        max_model_len: int = 1024,
        prefix_caching: bool = True,
        policy: str = "fcfs",
        window: int | None = None,
    ) -> None:
        self.bm = BlockManager(num_blocks, block_size, prefix_caching, window=window)
        self.sched = Scheduler(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            block_manager=self.bm,
            policy=policy,
        )
        self.kv: dict[tuple[int, int], int] = {}  # (block, slot) -> token whose K/V is there
        self.batches: list[list[ScheduledSeq]] = []
        self.finished: list[Sequence] = []

    def add(self, rid: str, prompt: list[int], max_tokens: int, priority: int = 0, arrival: float = 0.0) -> Sequence:
        seq = Sequence.new(rid, prompt, SamplingParams(max_tokens=max_tokens), arrival, priority)
        self.sched.add(seq)
        return seq

    def step(self) -> list[ScheduledSeq]:
        batch = self.sched.schedule()
        self.batches.append(batch)
        bs = self.bm.block_size
        assert sum(s.num_new_tokens for s in batch) <= self.sched.max_num_batched_tokens
        assert len({id(s.seq) for s in batch}) == len(batch) <= self.sched.max_num_seqs
        writers: dict[int, str] = {}
        for s in batch:
            seq = s.seq
            assert seq.status is SeqStatus.RUNNING and s.num_new_tokens > 0
            assert len(seq.block_table) * bs >= s.start + s.num_new_tokens
            for pos in range(s.start, s.start + s.num_new_tokens):
                block = seq.block_table[pos // bs]
                assert writers.setdefault(block, seq.request_id) == seq.request_id, "shared write"
                self.kv[(block, pos % bs)] = seq.token_ids[pos]
        sampling = [s.seq for s in batch if s.samples]
        window = self.bm.window
        for s in batch:  # attention reads: every position up to the last one computed (within the window)
            seq = s.seq
            for pos in range(0 if window is None else max(0, s.start - window + 1), s.start + s.num_new_tokens):
                assert self.kv.get((seq.block_table[pos // bs], pos % bs)) == seq.token_ids[pos]
        done = []
        for seq in sampling:
            seq.token_ids.append(hash((seq.request_id, seq.num_tokens)) % 1000)  # fake sampling
            if seq.num_output_tokens >= seq.params.max_tokens:
                done.append(seq)
        self.sched.update(batch)
        for seq in done:
            self.sched.finish(seq, "length")
            self.finished.append(seq)
        return batch

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished:
                return
            assert self.step() or not self.sched.has_unfinished, "nothing scheduled: deadlock"
        raise AssertionError("did not finish")


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000) for _ in range(n)]


def test_all_finish_and_blocks_come_back() -> None:
    eng = FakeEngine(num_blocks=64)
    rng = random.Random(0)
    seqs = [eng.add(str(i), prompt(rng, rng.randrange(1, 40)), rng.randrange(1, 20)) for i in range(20)]
    eng.run()
    assert all(s.status is SeqStatus.FINISHED for s in seqs)
    assert all(s.num_output_tokens == s.params.max_tokens for s in seqs)
    assert eng.bm.num_free_blocks == 64 and eng.bm.num_used_blocks == 0
    assert eng.sched.num_running == eng.sched.num_waiting == 0
    assert all(s.scheduled_time > 0 and s.num_cached_tokens >= 0 for s in seqs)


def test_chunked_prefill_respects_budget_and_keeps_decodes_running() -> None:
    eng = FakeEngine(num_blocks=200, max_num_batched_tokens=16)
    rng = random.Random(1)
    decoders = [eng.add(f"d{i}", prompt(rng, 3), 30) for i in range(4)]
    eng.step()  # the four short prompts: 12 tokens
    long = eng.add("long", prompt(rng, 100), 2)
    chunks = []
    while long.num_computed_tokens < 100:
        batch = eng.step()
        sizes = {s.seq.request_id: s.num_new_tokens for s in batch}
        assert all(sizes.get(d.request_id) == 1 for d in decoders)  # decodes never stall
        chunks.append(sizes["long"])
    assert chunks[:-1] == [12] * (len(chunks) - 1) and sum(chunks) == 100
    eng.run()


def test_preemption_under_tiny_cache_recomputes_and_finishes() -> None:
    eng = FakeEngine(num_blocks=12, max_num_seqs=6, max_num_batched_tokens=24)
    rng = random.Random(2)
    seqs = [eng.add(str(i), prompt(rng, rng.randrange(2, 12)), 30) for i in range(10)]
    eng.run()
    assert eng.sched.num_preemptions > 0
    assert sum(s.num_preemptions for s in seqs) == eng.sched.num_preemptions
    assert all(s.num_output_tokens == 30 for s in seqs)
    assert eng.bm.num_used_blocks == 0


def test_preemption_without_prefix_caching() -> None:
    eng = FakeEngine(num_blocks=10, max_num_seqs=4, prefix_caching=False)
    rng = random.Random(3)
    seqs = [eng.add(str(i), prompt(rng, 5), 30) for i in range(6)]
    eng.run()
    assert eng.sched.num_preemptions > 0 and all(s.num_output_tokens == 30 for s in seqs)
    assert eng.bm.num_free_blocks == 10


def test_preempted_victim_is_the_newest() -> None:
    eng = FakeEngine(num_blocks=6, max_num_seqs=4)
    a = eng.add("a", list(range(4)), 16, arrival=1.0)
    b = eng.add("b", list(range(10, 14)), 16, arrival=2.0)
    for _ in range(12):
        eng.step()
        if b.num_preemptions:
            break
    assert b.num_preemptions == 1 and a.num_preemptions == 0
    assert b.status is SeqStatus.WAITING and b.block_table == [] and b.num_computed_tokens == 0
    eng.run()
    assert a.num_output_tokens == b.num_output_tokens == 16


def test_shared_prefix_is_computed_once() -> None:
    eng = FakeEngine(num_blocks=100, block_size=16, max_num_batched_tokens=2048)
    p = list(range(512))
    first = eng.add("a", p, 1)
    eng.run()
    second = eng.add("b", p, 1)
    eng.run()
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 496
    st = eng.sched.stats()
    assert st.prefix_cache_hits == 496 and st.prefix_cache_queries == 1024
    assert [s.num_new_tokens for s in eng.batches[-1]] == [16]


@pytest.mark.parametrize(
    ("policy", "expected"),
    [("priority", ["high", "mid-a", "mid-b", "late-low"]), ("fcfs", ["late-low", "mid-a", "mid-b", "high"])],
)
def test_priority_then_arrival_order(policy: str, expected: list[str]) -> None:
    """--scheduling-policy priority: (priority, arrival); fcfs (the default): arrival only, priority ignored."""
    eng = FakeEngine(num_blocks=50, max_num_seqs=1, policy=policy)
    order = []
    for rid, prio, arrival in [("late-low", 5, 1.0), ("high", 0, 3.0), ("mid-b", 2, 2.5), ("mid-a", 2, 2.0)]:
        eng.add(rid, [1, 2, 3], 2, priority=prio, arrival=arrival)
    while eng.sched.has_unfinished:
        for s in eng.step():
            if s.seq.request_id not in order:
                order.append(s.seq.request_id)
    assert order == expected


def test_scheduling_policy_is_checked() -> None:
    with pytest.raises(ValueError, match="fcfs or priority"):
        FakeEngine(num_blocks=4, policy="lifo")


def test_max_num_seqs_caps_running() -> None:
    eng = FakeEngine(num_blocks=100, max_num_seqs=3)
    for i in range(7):
        eng.add(str(i), [1, 2, 3], 5)
    eng.step()
    assert eng.sched.num_running == 3 and eng.sched.num_waiting == 4
    eng.run()


def test_abort_100_frees_every_block() -> None:
    eng = FakeEngine(num_blocks=400, max_num_seqs=64, max_num_batched_tokens=256)
    rng = random.Random(4)
    seqs = [eng.add(str(i), prompt(rng, rng.randrange(1, 30)), 50) for i in range(100)]
    for _ in range(5):
        eng.step()
    assert eng.sched.num_running > 0 and eng.sched.num_waiting > 0
    aborted = eng.sched.abort([s.request_id for s in seqs] + ["unknown"])
    assert len(aborted) == 100
    assert all(s.status is SeqStatus.FINISHED and s.finish_reason == "abort" for s in seqs)
    assert eng.bm.num_free_blocks == 400 and eng.bm.num_used_blocks == 0
    assert not eng.sched.has_unfinished and eng.sched.schedule() == []
    assert eng.sched.abort(["0"]) == []  # twice: ignored


def test_refusals() -> None:
    eng = FakeEngine(num_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(RequestRefused, match="empty"):
        eng.add("a", [], 5)
    with pytest.raises(RequestRefused, match="context length"):
        eng.add("b", list(range(60)), 5)
    with pytest.raises(RequestRefused, match="KV cache blocks"):
        eng.add("c", list(range(10)), 8)  # 17 tokens of K/V > 16 slots
    eng.add("d", list(range(10)), 7)  # 16 tokens of K/V: fits exactly
    eng.run()
    assert eng.sched.stats().num_total_blocks == 4


def test_stats_track_the_queue() -> None:
    eng = FakeEngine(num_blocks=20, max_num_seqs=2)
    for i in range(3):  # distinct prompts: siblings with one prompt would share blocks
        eng.add(str(i), [1 + i, 2, 3, 4, 5], 3)
    st = eng.sched.stats()
    assert (st.num_running, st.num_waiting, st.num_used_blocks) == (0, 3, 0)
    eng.step()
    st = eng.sched.stats()
    assert (st.num_running, st.num_waiting, st.num_used_blocks) == (2, 1, 4)


def test_prompt_logprobs_requests_skip_the_prefix_cache() -> None:
    eng = FakeEngine(num_blocks=50)
    eng.add("a", list(range(20)), 1)
    eng.run()
    seq = Sequence.new("b", list(range(20)), SamplingParams(max_tokens=1, prompt_logprobs=1), 0.0)
    eng.sched.add(seq)
    eng.run()
    assert seq.num_cached_tokens == 0
    assert eng.add("c", list(range(20)), 1) and eng.sched.schedule()[0].start == 16


def test_every_running_sequence_advances_every_step() -> None:
    """More sequences than tokens per step: none may starve at the back of the queue."""
    eng = FakeEngine(num_blocks=200, max_num_seqs=64, max_num_batched_tokens=8)
    seqs = [eng.add(str(i), [i, i + 1], 6) for i in range(20)]
    for _ in range(200):
        if not eng.sched.has_unfinished:
            break
        before = [s for s in seqs if s.status is SeqStatus.RUNNING]
        scheduled = {id(b.seq) for b in eng.step()}
        assert all(id(s) in scheduled for s in before)
    assert all(s.num_output_tokens == 6 for s in seqs)


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_low_priority_is_preempted_first(policy: str) -> None:
    """Under fcfs the newest is preempted whatever its priority."""
    eng = FakeEngine(num_blocks=6, max_num_seqs=4, policy=policy)
    low = eng.add("low", list(range(4)), 16, priority=9, arrival=0.0)
    high = eng.add("high", list(range(10, 14)), 16, priority=0, arrival=5.0)
    victim, kept = (low, high) if policy == "priority" else (high, low)
    for _ in range(12):
        eng.step()
        if victim.num_preemptions:
            break
    assert victim.num_preemptions == 1 and kept.num_preemptions == 0
    eng.run()


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_lower_priority_decodes_sit_out_a_higher_prompt(policy: str) -> None:
    """Under priority, a running low-priority decode sits out the steps of a higher-priority prompt's prefill
    (its KV kept, not preempted) and runs again beside that request's decode; fcfs never pauses."""
    eng = FakeEngine(num_blocks=200, max_num_batched_tokens=16, policy=policy)
    rng = random.Random(3)
    low = [eng.add(f"low{i}", prompt(rng, 3), 40, priority=9) for i in range(3)]
    eng.step()
    eng.step()  # the low ones decode
    high = eng.add("high", prompt(rng, 40), 4, priority=0, arrival=1.0)
    prefill_steps = []
    while high.num_computed_tokens < 40:
        prefill_steps.append({s.seq.request_id for s in eng.step()})
    assert len(prefill_steps) == (3 if policy == "priority" else 4)  # 16 tokens a step, alone or beside 3
    for ids in prefill_steps:
        assert "high" in ids and (ids == {"high"} if policy == "priority" else len(ids) == 4)
    assert {s.seq.request_id for s in eng.step()} == {"high", "low0", "low1", "low2"}  # its decode: all run
    assert all(s.num_preemptions == 0 for s in low) and eng.bm.num_used_blocks > 0
    eng.run()
    assert all(s.num_output_tokens == 40 for s in low)


def test_paused_decodes_run_when_the_higher_prompt_cannot_start() -> None:
    """A waiting high-priority prompt that finds no blocks pauses nobody: the low decodes go on (no empty step)."""
    eng = FakeEngine(num_blocks=6, block_size=4, max_num_batched_tokens=64, policy="priority")
    low = eng.add("low", list(range(8)), 8, priority=9)
    eng.step()
    high = eng.add("high", list(range(100, 120)), 4, priority=0, arrival=1.0)  # 5+ blocks: not while low runs
    batch = eng.step()
    assert [s.seq.request_id for s in batch] == ["low"] and high.status is SeqStatus.WAITING
    eng.run()
    assert low.num_output_tokens == 8 and high.num_output_tokens == 4


def test_aborting_most_of_a_long_queue_keeps_order_and_memory() -> None:
    eng = FakeEngine(num_blocks=100, max_num_seqs=2)
    seqs = [eng.add(str(i), [i % 50 + 1, 2], 2, arrival=float(i)) for i in range(300)]
    eng.sched.abort([str(i) for i in range(300) if i % 10])  # keep every tenth
    assert eng.sched.num_waiting == 30 and len(eng.sched._waiting) < 200
    order = []
    while eng.sched.has_unfinished:
        order += [s.seq.request_id for s in eng.step() if s.seq.request_id not in order]
    assert order == [str(i) for i in range(0, 300, 10)]
    assert all(s.num_output_tokens == 2 for s in seqs[::10])


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_window_releases_blocks_under_preemption_and_prefix_hits(prefix_caching: bool) -> None:
    """A window on every layer: passed blocks go back to the pool while every read still finds its token."""
    rng = random.Random(9)
    shared = prompt(rng, 14)
    eng = FakeEngine(num_blocks=7, block_size=4, max_num_batched_tokens=6, prefix_caching=prefix_caching, window=5)
    for i in range(8):  # 40+ tokens each: without releases, one request alone would need 11+ blocks
        eng.add(str(i), shared + prompt(rng, rng.randrange(1, 20)), rng.randrange(25, 40), arrival=float(i))
    eng.run()
    assert len(eng.finished) == 8 and eng.bm.num_used_blocks == 0
    assert eng.sched.num_preemptions > 0
    assert (eng.bm.prefix_cache_hits > 0) == prefix_caching


def test_window_accepts_requests_longer_than_the_cache() -> None:
    eng = FakeEngine(num_blocks=4, block_size=4, max_num_batched_tokens=4, window=6)
    eng.add("long", list(range(30)), 40)  # 70 tokens, 18 blocks; the window holds at most 4
    with pytest.raises(RequestRefused, match="KV cache blocks"):
        FakeEngine(num_blocks=4, block_size=4, max_num_batched_tokens=4).add("long", list(range(30)), 40)
    eng.run()
    assert eng.finished[0].num_output_tokens == 40
