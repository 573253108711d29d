"""--speculative-config: read as JSON, checked at start-up (one line naming it), handed to the engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from server.cli import config_from_args, main

GOOD = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'


def test_flag_reaches_the_engine_config() -> None:
    config = config_from_args(["--speculative-config", GOOD])
    assert config.engine.speculative_config["num_speculative_tokens"] == 3
    assert config.engine_config().speculative_config == config.engine.speculative_config
    assert config_from_args([]).engine_config().speculative_config == {}


def test_env_variable() -> None:
    from server.config import ServerConfig

    config = ServerConfig.from_env({"SPINDLE_SPECULATIVE_CONFIG": GOOD})
    assert config.engine_config().speculative_config["prompt_lookup_min"] == 2


@pytest.mark.parametrize(
    "text,words",
    [
        ("{not json", "--speculative-config: not JSON"),
        ('["ngram"]', "--speculative-config: expected a JSON object"),
        ('{"method": "eagle3", "num_speculative_tokens": 2}', "method must be one of ngram, draft_model"),
        ('{"method": "ngram"}', "num_speculative_tokens must be 1..32, got None"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "got 0"),
        ('{"method": "ngram", "num_speculative_tokens": 33}', "got 33"),
        ('{"model": "/no/such/draft", "num_speculative_tokens": 2}', "draft model '/no/such/draft' does not exist"),
    ],
)
def test_bad_config_stops_start_up_with_one_line(text: str, words: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--speculative-config", text]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1, err


def test_draft_vocabulary_mismatch_stops_start_up(
    qwen2_ckpt: Path, llama_ckpt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Checked in the API process before any engine starts: exit status 2 and one line naming the mismatch."""
    spec = json.dumps({"model": str(llama_ckpt), "num_speculative_tokens": 2})
    assert main(["--model", str(qwen2_ckpt), "--speculative-config", spec]) == 2
    err = capsys.readouterr().err
    assert "vocabulary does not match" in err and "151646 tokens, the draft's 32000" in err and err.count("\n") == 1
    same = json.dumps({"model": str(qwen2_ckpt), "num_speculative_tokens": 2})
    assert config_from_args(["--model", str(qwen2_ckpt), "--speculative-config", same]).engine.speculative_config
