"""Speculative decoding under tensor parallel (TP=2, rank 1 a child process): greedy output identical to plain
decoding at TP=1, with an n-gram oracle (accepting and rejecting) and with a draft model on rank 0 alone.

The plan carries each verification's k + 1 ids and its draft count, so every rank runs the same rows; only
rank 0 samples, and the next plan carries what it accepted (engine/distributed/plan.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.distributed.plan import GENERATE, batch_of, decode, encode, plan_of
from tests.engine.distributed.test_tensor_parallel import run, tp_core
from tests.engine.spec.test_spec_engine import NGRAM, REGIMES, prompts, reference
from tests.helpers.engine import greedy, make_core, tokens


def test_the_plan_carries_a_verification() -> None:
    from engine.types.sequence import ScheduledSeq, Sequence

    seq = Sequence.new("s", [5, 6, 7, 8], greedy(10), 0.0)
    seq.num_computed_tokens, seq.block_table, seq.draft = 3, [4, 9], [11, 12, 13]
    s = ScheduledSeq(seq, 3, 2)  # the last token and two of the three draft tokens
    [got] = batch_of(decode(encode(plan_of(GENERATE, [s]))))
    assert got.input_ids() == [8, 11, 12] and got.num_draft == 2 and got.samples and got.start == 3
    assert got.seq.block_table == [4, 9]


@pytest.mark.parametrize("regime", ["together", "preemption"])
def test_ngram_greedy_identical_under_tp2(
    qwen2_ckpt: Path, oracle: dict[tuple[int, ...], list[int]], regime: str
) -> None:
    plain = make_core(qwen2_ckpt, **REGIMES[regime])
    ps = prompts(plain.vocab_size, seed=5 + len(regime), lengths=[3, 17, 30, 9])
    reqs = [(f"r{i}", p, greedy(24), 2 * i) for i, p in enumerate(ps)]
    want = reference(plain, reqs, oracle)
    spec = tp_core(qwen2_ckpt, 2, speculative_config=NGRAM, **REGIMES[regime])
    outs = run(spec, reqs)
    for rid, *_ in reqs:
        assert tokens(outs[rid]) == want[rid], rid
    st = spec.stats()
    assert st.num_used_blocks == 0 and st.num_running == 0
    assert 0 < st.spec_num_accepted_tokens < st.spec_num_draft_tokens  # both paths ran on both ranks
    if regime == "preemption":
        assert st.num_preemptions > 0


@pytest.mark.usefixtures("free_draft")
def test_draft_model_greedy_identical_under_tp2(qwen2_ckpt: Path, noisy_draft: Path) -> None:
    """The draft runs unsharded in rank 0's process; the other rank only ever sees verifications."""
    reqs = [(f"r{i}", p, greedy(20), i) for i, p in enumerate(prompts(1000, seed=8, lengths=[5, 21, 12]))]
    want = {rid: tokens(o) for rid, o in run(make_core(qwen2_ckpt), reqs).items()}
    spec = tp_core(qwen2_ckpt, 2, speculative_config={"model": str(noisy_draft), "num_speculative_tokens": 3})
    outs = run(spec, reqs)
    assert {rid: tokens(o) for rid, o in outs.items()} == want
    st = spec.stats()
    assert 0 < st.spec_num_accepted_tokens < st.spec_num_draft_tokens
