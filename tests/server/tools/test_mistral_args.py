"""Mistral's newer form, [TOOL_CALLS]name[ARGS]{...}: read whole or cut anywhere, and enforced by a grammar."""

from __future__ import annotations

import json
from typing import Any

import llguidance
import pytest

from engine.structured.grammar import to_grammar, validate
from server.tools.choice import plan_tools
from server.tools.parser import MistralParser, ToolCall, assemble

TEXTS = [
    'Checking. [TOOL_CALLS]get_weather[ARGS]{"city": "Pa}ris\\"", "n": [1, {"a": 2}]}',
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]noop[ARGS]{}',
    '[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e[ARGS]{"zone": "UTC"}',
    '[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}]',  # the older list form still reads
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Ro',  # cut by max_tokens
    "[TOOL_CALLS] no arguments tag, just text",
    "[TOOL_CALLS]f[ARGS]not json",
    "plain [TOOL text",
]


def streamed(pieces: list[str]) -> tuple[str, list[ToolCall]]:
    parser = MistralParser()
    content, deltas = "", []
    for k, piece in enumerate(pieces):
        out = parser.feed(piece, final=k == len(pieces) - 1)
        content += out.content
        deltas += out.calls
    return content, assemble(deltas)


def key(calls: list[ToolCall]) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in calls]


def test_whole_texts() -> None:
    content, calls = MistralParser.extract(TEXTS[0])
    assert content == "Checking." and key(calls) == [("get_weather", '{"city": "Pa}ris\\"", "n": [1, {"a": 2}]}')]
    assert key(MistralParser.extract(TEXTS[1])[1]) == [("get_weather", '{"city": "Rome"}'), ("noop", "{}")]
    assert key(MistralParser.extract(TEXTS[2])[1]) == [("get_time", '{"zone": "UTC"}')]
    assert key(MistralParser.extract(TEXTS[3])[1]) == [("a", '{"x": 1}')]
    assert key(MistralParser.extract(TEXTS[4])[1]) == [("get_weather", '{"city": "Ro')]
    assert MistralParser.extract(TEXTS[5]) == ("[TOOL_CALLS] no arguments tag, just text", [])
    assert MistralParser.extract(TEXTS[7]) == ("plain [TOOL text", [])
    assert all(len(c.id) == 9 and c.id.isalnum() for c in MistralParser.extract(TEXTS[1])[1])


@pytest.mark.parametrize("text", TEXTS)
def test_any_cut_equals_the_whole(text: str) -> None:
    whole = MistralParser.extract(text)
    want = (whole[0] or "", key(whole[1]))
    for cut in range(len(text) + 1):
        content, calls = streamed([text[:cut], text[cut:]])
        assert (content, key(calls)) == want, cut
    content, calls = streamed(list(text))  # one character at a time
    assert (content, key(calls)) == want


TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 8}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {"type": "function", "function": {"name": "noop"}},
]
V11_IDS = {"[TOOL_CALLS]": 5, "[ARGS]": 32}.get


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_v11_tokenizer_gets_the_newer_form_enforced(choice: Any) -> None:
    plan = plan_tools(TOOLS, choice, parser_name="mistral", enable_auto=True, token_id=V11_IDS)
    so = plan.constraint
    assert so is not None and validate(so) is None, so
    assert "<[5]>" in so.spec and "<[32]>" in so.spec and "%json" in so.spec
    older = plan_tools(TOOLS, choice, parser_name="mistral", enable_auto=True, token_id={"[TOOL_CALLS]": 5}.get)
    assert older.constraint is not None and "<[32]>" not in older.constraint.spec  # no [ARGS]: the list form
    # the grammar accepts what the parser reads: text as byte tokens, the tags as their ids
    tok = byte_tokenizer({5: "[TOOL_CALLS]", 32: "[ARGS]"})
    matcher = llguidance.LLMatcher(tok, to_grammar(so), log_level=0)
    text = "[TOOL_CALLS]get_weather[ARGS]" + json.dumps({"city": "Rome"})
    ids = [5, *tok.tokenize_str("get_weather"), 32, *tok.tokenize_str(json.dumps({"city": "Rome"}))]
    assert matcher.consume_tokens(ids), matcher.get_error()
    assert matcher.is_accepting() or matcher.is_stopped()
    assert key(MistralParser.extract(text)[1]) == [("get_weather", '{"city": "Rome"}')]


def byte_tokenizer(specials: dict[int, str]) -> llguidance.LLTokenizer:
    """A byte-level vocabulary (every byte one token) with control tokens at the given ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    size = 256 + len(specials)
    free = [i for i in range(size) if i not in specials]
    vocab = dict(zip(sorted(alphabet), free))
    tk = Tokenizer(models.BPE(vocab, []))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    data = json.loads(tk.to_str())
    data["added_tokens"] = [
        {
            "id": i,
            "content": t,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, t in specials.items()
    ]
    data["model"]["vocab"].update({t: i for i, t in specials.items()})
    return llguidance.LLTokenizer(json.dumps(data))
