"""reasoning_tokens (server/streaming/reasoning_tokens.py) against the tokenizer's own offsets: the tokens that
wrote the text through the first end tag, for every way the parser was fed."""

from __future__ import annotations

import random

import pytest
import tokenizers

from engine.models.hf_tokenizer import load_tokenizer
from server.reasoning.parser import DeepSeekR1Parser, Qwen3Parser, ReasoningParser
from server.streaming.reasoning_tokens import reasoning_tokens


@pytest.fixture(scope="module")
def tok() -> tokenizers.Tokenizer:
    return load_tokenizer("qwen2.5")


def fed(parser: ReasoningParser, text: str, seed: int) -> ReasoningParser:
    rng, i = random.Random(seed), 0
    while i < len(text):
        j = min(len(text), i + rng.randint(1, 6))
        parser.feed(text[i:j], False)
        i = j
    parser.feed("", True)
    return parser


@pytest.mark.parametrize("answer", ["Paris.", "", " 巴黎 🦊 is the answer</think> again"])
@pytest.mark.parametrize("seed", range(4))
def test_the_count_is_the_tokens_through_the_end_tag(tok: tokenizers.Tokenizer, answer: str, seed: int) -> None:
    text = "Let me think: 巴黎 is the capital 🦊.</think>" + answer
    enc = tok.encode(text, add_special_tokens=False)
    end = text.index("</think>") + len("</think>")
    want = next(i + 1 for i, (_, stop) in enumerate(enc.offsets) if stop >= end)  # the token ending the tag
    parser = fed(DeepSeekR1Parser(None), text, seed)
    assert reasoning_tokens(parser, enc.ids, tok.decode) == want
    assert 0 < want < len(enc.ids) or not answer


def test_open_reasoning_is_every_token_and_none_is_zero(tok: tokenizers.Tokenizer) -> None:
    ids = tok.encode("still thinking about it", add_special_tokens=False).ids
    assert reasoning_tokens(fed(DeepSeekR1Parser(None), "still thinking about it", 0), ids, tok.decode) == len(ids)
    assert reasoning_tokens(fed(Qwen3Parser(None), "an answer, no tags", 0), ids, tok.decode) == 0
    assert reasoning_tokens(None, ids, tok.decode) == 0
    closed = "<think>a b</think>c"
    ids = tok.encode(closed, add_special_tokens=False).ids
    n = reasoning_tokens(fed(Qwen3Parser(None), closed, 1), ids, tok.decode)
    assert "</think>" in tok.decode(ids[:n]) and "</think>" not in tok.decode(ids[:n - 1])  # ">c" is one token
