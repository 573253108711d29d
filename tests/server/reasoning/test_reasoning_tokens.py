"""reasoning_tokens (server/reasoning/token_count.py) against the tokenizer's own offsets: the tokens that
wrote the text through the first end tag, for every way the parser was fed."""

from __future__ import annotations

import json
import random

import pytest
import tokenizers

from demo.tokenizers import load_tokenizer
from server.families.openai.formatter import ParsedChatFormatter
from server.families.responses.formatter import ResponsesFormatter
from server.reasoning.parser import DeepSeekR1Parser, Qwen3Parser, ReasoningParser
from server.reasoning.token_count import reasoning_tokens
from server.request.collector import Output
from server.request.openai_protocol import Usage
from server.structured.parsing import ChoiceParser


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
    assert "</think>" in tok.decode(ids[:n]) and "</think>" not in tok.decode(ids[: n - 1])  # ">c" is one token


def _outputs(tok: tokenizers.Tokenizer, ids: list[int]) -> list[Output]:
    """One output per token, its text the decoded difference (as the incremental detokenizer writes it)."""
    outs, prev = [], ""
    for k in range(len(ids)):
        text = tok.decode(ids[: k + 1])
        outs.append(Output(0, text[len(prev) :], [ids[k]], k + 1, "stop" if k == len(ids) - 1 else None))
        prev = text
    return outs


def test_chat_and_responses_usage_count_them_streamed_and_not(tok: tokenizers.Tokenizer) -> None:
    text = "think 巴黎 hard</think>The answer is 42."
    ids = tok.encode(text, add_special_tokens=False).ids
    want = reasoning_tokens(fed(DeepSeekR1Parser(None), text, 0), ids, tok.decode)
    usage = Usage(5, len(ids), 5 + len(ids))
    chat = ParsedChatFormatter(
        "c", 0, "m", 1, None, False, tools=None, reasoning="deepseek_r1", prompt="", decode=tok.decode
    )
    body = json.loads(chat.final([Output(0, text, ids, len(ids), "stop")], usage))
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": want}
    assert body["choices"][0]["message"]["content"] == "The answer is 42."
    streamed = ParsedChatFormatter(
        "c", 0, "m", 1, None, False, tools=None, reasoning="deepseek_r1", prompt="", decode=tok.decode
    )
    for out in _outputs(tok, ids):
        streamed.stream_chunk([out], None)
    last = json.loads(streamed.usage_chunk(usage)[len(b"data: ") :])
    assert last["usage"]["completion_tokens_details"] == {"reasoning_tokens": want}

    def parser() -> ChoiceParser:
        return ChoiceParser(DeepSeekR1Parser(None), None)

    whole = ResponsesFormatter({"id": "resp_1"}, 5, parser, decode=tok.decode)
    assert json.loads(whole.final([Output(0, text, ids, len(ids), "stop")], usage))["usage"][
        "output_tokens_details"
    ] == {"reasoning_tokens": want}
    fmt = ResponsesFormatter({"id": "resp_1"}, 5, parser, decode=tok.decode)
    fmt.stream_start()
    for out in _outputs(tok, ids):
        fmt.stream_chunk([out], None)
    assert fmt.done is not None and fmt.done["usage"]["output_tokens_details"] == {"reasoning_tokens": want}
    assert 0 < want < len(ids)
