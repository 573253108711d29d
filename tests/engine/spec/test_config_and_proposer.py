"""--speculative-config's checks, the n-gram proposer and the adaptive draft length."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.spec import ngram
from engine.spec.adaptive import DEFAULT_COST, PROBE_EVERY, DraftState, StepCost, draft_length
from engine.spec.config import MAX_SPECULATIVE_TOKENS, SpecConfig, parse_spec_config


def test_ngram_config_and_defaults() -> None:
    assert parse_spec_config({}) is None
    assert parse_spec_config(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    ) == SpecConfig("ngram", 3, 4, 2)
    assert parse_spec_config({"method": "ngram", "num_speculative_tokens": 1}) == SpecConfig("ngram", 1, 5, 5)
    assert parse_spec_config({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}) == SpecConfig(
        "ngram", 2, 3, 3
    )
    top = parse_spec_config({"method": "ngram", "num_speculative_tokens": MAX_SPECULATIVE_TOKENS})
    assert top is not None and top.num_speculative_tokens == MAX_SPECULATIVE_TOKENS


@pytest.mark.parametrize(
    "raw,words",
    [
        ({"method": "ngram"}, "num_speculative_tokens must be 1..32, got None"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be 1..32, got 0"),
        ({"method": "ngram", "num_speculative_tokens": MAX_SPECULATIVE_TOKENS + 1}, "got 33"),
        ({"method": "ngram", "num_speculative_tokens": "3"}, "must be an integer"),
        ({"method": "medusa", "num_speculative_tokens": 3}, "method must be one of ngram, draft_model"),
        ({"method": "ngram", "num_speculative_tokens": 3, "lookahead": 2}, "unknown key 'lookahead'"),
        (
            {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "prompt_lookup_min <= prompt_lookup_max",
        ),
        ({"method": "draft_model", "num_speculative_tokens": 3}, 'needs "model"'),
        ({"model": "/nonexistent/draft", "num_speculative_tokens": 3}, "'/nonexistent/draft' does not exist"),
    ],
)
def test_bad_configs_name_the_problem(raw: dict[str, object], words: str) -> None:
    with pytest.raises(ValueError, match="--speculative-config") as e:
        parse_spec_config(raw)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_draft_model_config(tmp_path: Path) -> None:
    want = SpecConfig("draft_model", 3, model=str(tmp_path))
    assert parse_spec_config({"model": str(tmp_path), "num_speculative_tokens": 3}) == want
    assert parse_spec_config({"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 3}) == want


def test_engine_config_checks_it() -> None:
    good = {"method": "ngram", "num_speculative_tokens": 2}
    assert EngineConfig(model="m", speculative_config=good).speculative_config == good
    with pytest.raises(ValueError, match="tensor-parallel"):
        EngineConfig(model="m", speculative_config=good, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="runner generate"):
        EngineConfig(model="m", speculative_config=good, runner="pooling")
    with pytest.raises(ValueError, match="unknown key"):
        EngineConfig(model="m", speculative_config={"k": 1})


def test_ngram_proposes_what_followed_the_latest_match() -> None:
    text = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert ngram.propose(text, 2, 3, 1) == [7, 8]  # the latest of the two earlier "1 2 3"
    assert ngram.propose(text, 5, 3, 1) == [7, 8, 1, 2, 3]
    assert ngram.propose([5, 6, 7, 8], 3, 3, 1) == []  # nothing repeats
    assert ngram.propose([4, 4, 4], 2, 2, 2) == [4]
    assert ngram.propose([1, 2, 1], 3, 2, 1) == [2, 1]  # the longest suffix found falls back to shorter ones
    assert ngram.propose(text, 0, 3, 1) == []
    assert ngram.propose([7] * 6, 3, 2, 2) == [7, 7, 7]  # a run: a full draft, not the one token after the last
    assert ngram.propose([1, 2, 9, 1, 2, 8, 1, 2], 4, 2, 2) == [9, 1, 2, 8]  # the latest is too short: the earliest


def test_draft_length_follows_acceptance() -> None:
    fresh = DraftState()
    assert draft_length(fresh, DEFAULT_COST, 5) == 5  # optimistic before any trial
    assert draft_length(DraftState(), DEFAULT_COST, 2) == 2  # never above the room left
    poor = DraftState()
    for _ in range(20):
        poor.record(4, 0)
    assert poor.acceptance < DEFAULT_COST
    lengths = [draft_length(poor, DEFAULT_COST, 4) for _ in range(2 * PROBE_EVERY)]
    assert lengths.count(1) == 2 and set(lengths) == {0, 1}  # off, but probed now and then
    good = DraftState()
    for _ in range(20):
        good.record(4, 4)
    assert draft_length(good, DEFAULT_COST, 4) == 4
    assert draft_length(good, 1.0, 4) == 0  # a token costing a whole step never pays


def test_step_cost_fit() -> None:
    cost = StepCost()
    assert cost.relative(1) == DEFAULT_COST and cost.pays(1, 0.0, 5)  # nothing measured: try
    for tokens in [1, 2, 3, 4, 5, 6, 7, 8] * 2:
        cost.record(tokens, False, 0.010 + 0.001 * tokens)  # base 10 ms, 1 ms a token
    assert cost.relative(1) == pytest.approx(0.001 / 0.011)
    assert cost.relative(8) == pytest.approx(0.008 / 0.018)
    for tokens in [2, 6, 7, 12] * 2:
        cost.record(tokens, True, 0.015 + 0.001 * tokens)  # a verification costs the step 5 ms more
    fit = cost.fit()
    assert fit is not None and fit == pytest.approx((0.010, 0.001, 0.005))
    # one sequence: a plain step is 11 ms; 4 draft tokens cost 9 ms, so 0.8 expected tokens do not pay, 0.9 do
    assert not cost.pays(1, 0.8, 4) and cost.pays(1, 0.9, 4)
