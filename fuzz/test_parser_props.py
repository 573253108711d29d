"""Property-based tests of the tool-call parsers (server/tools/) and reasoning parsers (server/reasoning/).

Streamed in any cuts, a parser gives exactly what it gives for the whole text (calls assembled as the openai SDK
does, content and reasoning concatenated), never raises on odd content, and reads back the calls a well-formed
output holds. Bounded for CI; raise SPINDLE_FUZZ_EXAMPLES for a longer run.
"""

from __future__ import annotations

import json
import os
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server.reasoning.parser import REASONING_PARSERS
from server.tools.parser import HermesParser, JsonCallParser, JsonListParser, MistralParser, ToolCall, assemble

EXAMPLES = int(os.environ.get("SPINDLE_FUZZ_EXAMPLES", "150"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize="SPINDLE_FUZZ_EXAMPLES" not in os.environ,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
PARSERS: list[type[JsonCallParser]] = [HermesParser, MistralParser, JsonListParser]
# Pieces odd outputs are made of: tags (whole and split), JSON punctuation, quotes, escapes, whitespace.
FRAGMENTS = [
    "<tool_call>",
    "</tool_call>",
    "<tool",
    "_call>",
    "</",
    "[TOOL_CALLS]",
    "[TOOL",
    "[ARGS]",
    "[AR",
    "[CALL_ID]",
    "<think>",
    "</think>",
    "<thi",
    "nk>",
    "{",
    "}",
    "[",
    "]",
    '"',
    "\\",
    '\\"',
    ":",
    ",",
    " ",
    "\n",
    '"name"',
    '"arguments"',
    '"parameters"',
    '"f"',
    "1",
    "true",
    "null",
    "x",
    "é",
    "{}",
    '{"a": "}"}',
]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | st.text(alphabet='ab"\\{}[]:, \n\té<>', max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text("abk", max_size=3), inner, max_size=3),
    max_leaves=8,
)
names = st.text(alphabet="abcdefgh_.", min_size=1, max_size=8)
calls_st = st.lists(
    st.tuples(names, st.dictionaries(st.text('abk"', max_size=4), json_values, max_size=3)), min_size=1, max_size=3
)
prose = st.text(alphabet='ab <>{}[]"\n:', max_size=12)
odd_texts = st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=3), max_size=30).map("".join)


def cuts(text: str, data: st.DataObject) -> list[str]:
    points = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=12)))
    bounds = [0, *points, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def stream(parser_cls: type[JsonCallParser], pieces: list[str]) -> tuple[str, list[ToolCall]]:
    parser = parser_cls()
    content, deltas = "", []
    for i, piece in enumerate(pieces):
        out = parser.feed(piece, final=i == len(pieces) - 1)
        content += out.content
        deltas.extend(out.calls)
    if not pieces:
        out = parser.feed("", final=True)
        content += out.content
        deltas.extend(out.calls)
    seen: set[int] = set()
    for d in deltas:  # index, id and name once, then argument fragments only
        if d.name is not None:
            assert d.index not in seen and d.id and d.arguments == ""
            seen.add(d.index)
        else:
            assert d.index in seen and d.id is None
    return content, assemble(deltas)


def strip_ids(calls: list[ToolCall]) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in calls]


def render(parser_cls: type[JsonCallParser], calls: list[tuple[str, Any]], sep: str) -> str:
    objs = [
        json.dumps({"name": n, "arguments" if parser_cls is not JsonListParser else "parameters": a}) for n, a in calls
    ]
    if parser_cls is HermesParser:
        return sep.join(f"<tool_call>{sep}{o}{sep}</tool_call>" for o in objs)
    body = "[" + ("," + sep).join(objs) + "]"
    return ("[TOOL_CALLS]" + body) if parser_cls is MistralParser else body


@FUZZ
@given(st.sampled_from(PARSERS), odd_texts, st.data())
def test_any_cut_equals_the_whole_and_nothing_raises(
    parser_cls: type[JsonCallParser], text: str, data: st.DataObject
) -> None:
    whole_content, whole_calls = parser_cls.extract(text)
    content, calls = stream(parser_cls, cuts(text, data))
    assert (content or None) == whole_content
    assert strip_ids(calls) == strip_ids(whole_calls)
    for c in whole_calls:
        assert c.name  # a call always has its name


@FUZZ
@given(st.sampled_from(PARSERS), calls_st, prose, st.sampled_from(["", "\n", " \n "]), st.data())
def test_well_formed_calls_are_read_back(
    parser_cls: type[JsonCallParser], calls: list[tuple[str, Any]], before: str, sep: str, data: st.DataObject
) -> None:
    if parser_cls is JsonListParser:
        before = ""  # the whole output is the list
    elif "<tool_call>" in before or "[TOOL_CALLS]" in before:
        before = ""
    text = before + ("\n" if before else "") + render(parser_cls, calls, sep)
    content, got = stream(parser_cls, cuts(text, data))
    assert [(c.name, json.loads(c.arguments)) for c in got] == [(json.loads(json.dumps(n)), a) for n, a in calls]
    whole_content, whole_calls = parser_cls.extract(text)
    assert strip_ids(got) == strip_ids(whole_calls) and (content or None) == whole_content
    assert whole_content == (before.rstrip(" \t\n\r") or None)
    if parser_cls is MistralParser:
        assert all(len(c.id) == 9 and c.id.isalnum() for c in got)
    else:
        assert all(c.id.startswith("call_") for c in got)


@FUZZ
@given(calls_st, prose, st.booleans(), st.data())
def test_mistral_args_form_calls_are_read_back(
    calls: list[tuple[str, Any]], before: str, call_ids: bool, data: st.DataObject
) -> None:
    """Mistral's newer form: [TOOL_CALLS]name[ARGS]{...} per call (a [CALL_ID]id between them or not)."""
    if "[TOOL_CALLS]" in before:
        before = ""
    text = before + "".join(
        f"[TOOL_CALLS]{n}" + ("[CALL_ID]a1b2c3d4e" if call_ids else "") + f"[ARGS]{json.dumps(a)}" for n, a in calls
    )
    content, got = stream(MistralParser, cuts(text, data))
    assert [(c.name, json.loads(c.arguments)) for c in got] == [(n, a) for n, a in calls]
    whole_content, whole_calls = MistralParser.extract(text)
    assert strip_ids(got) == strip_ids(whole_calls) and (content or None) == whole_content
    assert whole_content == (before.rstrip(" \t\n\r") or None)
    assert all(len(c.id) == 9 and c.id.isalnum() for c in got)


@FUZZ
@given(st.sampled_from(sorted(REASONING_PARSERS)), st.sampled_from([None, True, False]), odd_texts, st.data())
def test_reasoning_any_cut_equals_the_whole(name: str, in_prompt: bool | None, text: str, data: st.DataObject) -> None:
    cls = REASONING_PARSERS[name]
    whole = cls.extract(text, in_prompt)
    parser = cls(in_prompt)
    reasoning = content = ""
    pieces = cuts(text, data) or [""]
    for i, piece in enumerate(pieces):
        out = parser.feed(piece, final=i == len(pieces) - 1)
        reasoning += out.reasoning
        content += out.content
    assert ((reasoning or None), (content or None)) == whole
