"""--speculative-config's checks and the n-gram proposer (the adaptive draft length: test_adaptive.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.spec import ngram
from engine.spec_config import MAX_SPECULATIVE_TOKENS, SpecConfig, parse_spec_config


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
    assert EngineConfig(model="m", speculative_config=good, tensor_parallel_size=2).tensor_parallel_size == 2
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
