"""/api/generate's `context`: checked against the model's vocabulary and length, and continued by the next prompt's
ids without the tokenizer's leading BOS (the context has its own)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from server.families.ollama.context import checked_context, continued
from server.http.errors import APIError
from server.request.input_processor import ModelLimits

LIMITS = ModelLimits(max_model_len=8, vocab_size=10)


def tokenizer(bos: bool) -> Tokenizer:
    tok = Tokenizer(models.WordLevel({"<s>": 0, "a": 1, "b": 2, "[UNK]": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return tok


def test_checked() -> None:
    assert checked_context(None, False, LIMITS) is None and checked_context([], False, LIMITS) is None
    assert checked_context([0, 9, 3], False, LIMITS) == [0, 9, 3]
    for context, raw, words in (
        ([1], True, "raw"),
        ([1, 10], False, "context[1] is 10"),
        ([-1], False, "context[0] is -1"),
        ([1] * 8, False, "max_model_len"),
    ):
        with pytest.raises(APIError) as e:
            checked_context(context, raw, LIMITS)
        assert e.value.status == 400 and words in e.value.message


@pytest.mark.parametrize("bos", [True, False])
def test_continued_drops_the_new_prompts_bos(bos: bool) -> None:
    tok = tokenizer(bos)
    ids = tok.encode("a b").ids
    assert ids == ([0] if bos else []) + [1, 2]
    assert continued(None, ids, tok) == ids
    assert continued([0, 2, 1], ids, tok) == [0, 2, 1, 1, 2]
