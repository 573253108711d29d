"""Constrained requests speculate: the grammar cuts each draft at its first forbidden token, every verified row is
masked by the grammar after the draft tokens before it, and greedy output is the plain run's token for token."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from engine.messages import SamplingParams, StructuredOutputs
from engine.spec import speculator
from engine.structured.backend import allocate_bitmask
from engine.structured.drafts import allowed_prefix, draft_room
from engine.types.constraint_state import StructuredState
from engine.types.sequence import Sequence
from tests.engine.spec.test_spec_engine import NGRAM
from tests.engine.structured.conftest import make_core, run, shared_backend
from tests.engine.structured.test_engine import CONSTRAINTS, PROMPT, SCHEMA
from tests.helpers.engine import tokens

FREE = {
    "type": "object",
    "required": ["note", "n"],
    "properties": {"note": {"type": "string"}, "n": {"type": "integer"}},
}
CASES = {
    "json": (CONSTRAINTS["json"], 60),
    "regex": (CONSTRAINTS["regex"], 30),
    "grammar": (CONSTRAINTS["grammar"], 40),
    "free-form json, finished near max_tokens": (StructuredOutputs("json", json.dumps(FREE)), 40),
    "json_object": (CONSTRAINTS["json_object"], 50),
}


def params(so: StructuredOutputs, max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_outputs=so)


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_identical_with_drafts(qwen2_ckpt: Path, oracle: dict[tuple[int, ...], list[int]], case: str) -> None:
    so, max_tokens = CASES[case]
    rng = random.Random(len(case))
    prompts = [PROMPT, [rng.randrange(1000) for _ in range(9)], [rng.randrange(1000) for _ in range(14)]]
    reqs = [(f"r{i}", p, params(so, max_tokens)) for i, p in enumerate(prompts)]
    reqs.append(("free", prompts[1][:5], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)))
    plain = run(make_core(qwen2_ckpt), reqs)
    for rid, p, _ in reqs:
        oracle[tuple(p)] = p + tokens(plain[rid])
    spec = make_core(qwen2_ckpt, speculative_config=NGRAM)
    outs = run(spec, reqs)
    for rid, *_ in reqs:
        assert tokens(outs[rid]) == tokens(plain[rid]), (case, rid)
        assert (outs[rid][-1].finish_reason, outs[rid][-1].error) == (plain[rid][-1].finish_reason, None), rid
    st = spec.stats()
    assert st.spec_num_accepted_tokens > 0 and st.num_used_blocks == 0
    assert spec.structured.num_live == 0
    constrained = [rid for rid, *_ in reqs if rid != "free"]
    assert any(len(outs[rid]) < len(tokens(outs[rid])) for rid in constrained)  # a step emitted several tokens


def test_a_forbidden_draft_token_ends_the_draft(qwen2_ckpt: Path) -> None:
    core = make_core(qwen2_ckpt)
    backend = shared_backend(core)
    state = StructuredState(CONSTRAINTS["regex"], grammar=backend.compile(CONSTRAINTS["regex"]))
    enc = backend.tokenizer.tokenize_str
    good, bad = [int(t) for t in enc("ab")], [int(t) for t in enc("-")]
    assert allowed_prefix(state, good + bad + good) == good  # "ab-": the regex needs three letters first
    assert allowed_prefix(state, bad + good) == []
    assert state.grammar is not None and state.grammar.accept_tokens(good)  # the matcher itself did not move


def test_drafts_stop_short_of_the_forced_finish() -> None:
    state = StructuredState(CONSTRAINTS["regex"], grammar=object())  # type: ignore[arg-type]
    assert draft_room(state, 50) == 0  # the first step looks for a finish (check_at: never yet looked)
    state.check_at = 30
    assert draft_room(state, 50) == 19  # every row's budget stays above 30: plain decoding would not look there
    assert draft_room(state, 30) == 0
    state.closing = [5, 6]
    assert draft_room(state, 50) == 0  # a finish being forced: one token per step, as plain decoding
    state.closing, state.active = None, False
    assert draft_room(state, 50) == 0  # before reasoning_end a draft token could switch the constraint on


def test_each_verified_row_gets_the_mask_after_the_drafts_before_it(qwen2_ckpt: Path) -> None:
    core = make_core(qwen2_ckpt)
    backend = shared_backend(core)
    so = StructuredOutputs("json", json.dumps(SCHEMA))
    seq = Sequence.new("s", PROMPT, params(so, 200), 0.0)
    seq.structured = StructuredState(so, grammar=backend.compile(so), check_at=-1)  # no finish to look for
    draft = [int(t) for t in backend.tokenizer.tokenize_str('{"name":"ab')]
    assert allowed_prefix(seq.structured, draft) == draft
    seq.draft = draft
    rows = [seq] + [Sequence.new("s", PROMPT + draft[:j], seq.params, 0.0) for j in range(1, len(draft) + 1)]
    for r in rows[1:]:
        r.structured = seq.structured  # the verification's views share the state
    pending = core.structured.start_masks(rows)
    assert pending is not None
    pending.filled.result()
    got = pending.bitmask.clone()
    # plain decoding: one mask per position, the matcher advanced token by token
    want = allocate_bitmask(len(rows), backend.vocab_size)
    g = backend.compile(so)
    for j in range(len(rows)):
        g.fill_bitmask(want, j)
        if j < len(draft):
            assert g.accept_tokens([draft[j]])
    assert pending.rows == list(range(len(rows)))
    assert all(bool((got[j] == want[j]).all()) for j in range(len(rows)))
    assert len({bytes(got[j].numpy()) for j in range(len(rows))}) > 2  # the rows differ: not one mask reused


def test_constrained_sequences_are_offered_drafts() -> None:
    seq = Sequence.new("s", [1, 2], params(CONSTRAINTS["regex"], 8), 0.0)
    seq.structured = StructuredState(CONSTRAINTS["regex"])
    assert speculator.can_speculate(seq)
