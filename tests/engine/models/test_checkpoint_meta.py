"""engine/models/checkpoint_meta.py's tokenizer_token_count: the ids a tokenizer.json defines, as tokenizers counts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tokenizers

from demo.tokenizers import tokenizer_dir
from engine.models.checkpoint_meta import tokenizer_token_count


@pytest.mark.parametrize("family", ["qwen2", "qwen2.5", "llama"])
def test_the_count_is_the_tokenizers_vocabulary_with_added_tokens(family: str) -> None:
    folder = tokenizer_dir(family)  # type: ignore[arg-type]
    want = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    assert tokenizer_token_count(folder) == want


@pytest.mark.parametrize(
    ("data", "want"),
    [
        ({"model": {"vocab": {"a": 0, "b": 7}}, "added_tokens": [{"id": 9, "content": "x"}]}, 10),
        ({"model": {"vocab": [["a", 0.0], ["b", -1.5]]}, "added_tokens": None}, 2),  # Unigram: [piece, score]
        ({"model": {"vocab": []}}, None),
        ({"model": {}}, None),
        ({"model": {"vocab": {"a": "x"}}}, None),
    ],
)
def test_shapes_and_broken_files(tmp_path: Path, data: object, want: int | None) -> None:
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    assert tokenizer_token_count(tmp_path) == want


def test_no_file_or_not_json_is_none(tmp_path: Path) -> None:
    assert tokenizer_token_count(tmp_path) is None
    (tmp_path / "tokenizer.json").write_text("not json")
    assert tokenizer_token_count(tmp_path) is None
