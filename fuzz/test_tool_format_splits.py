"""Property-based tests of the llama3_json, pythonic and qwen3_coder tool-call parsers (server/tools/).

Streamed in any cuts, a parser gives exactly what it gives for the whole text, never raises on odd content, and
reads back the calls a well-formed output in its format holds. Bounded for CI; SPINDLE_FUZZ_EXAMPLES for more.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from test_parser_props import FUZZ, cuts, json_values, strip_ids

from server.tools.llama3 import Llama3JsonParser
from server.tools.parser import ToolCall, ToolParser, assemble
from server.tools.pythonic import PythonicParser
from server.tools.qwen3_coder import Qwen3CoderParser

FRAGMENTS = [
    "<|python_tag|>",
    "<|python",
    "<|python_start|>",
    "<tool_call>",
    "</tool_call>",
    "<tool",
    "\n",
    "<function=",
    "<function=f>",
    "</function>",
    "<parameter=",
    "<parameter=a>",
    "</parameter>",
    "</param",
    "[",
    "]",
    "f(",
    "g(",
    "a=",
    "b=",
    ")",
    ",",
    ";",
    "; ",
    "{",
    "}",
    '"',
    "'",
    "\\",
    ":",
    " ",
    "1",
    "-2.5",
    "True",
    "true",
    "None",
    "null",
    '"name"',
    '"parameters"',
    '"arguments"',
    '"f"',
    "x",
    "é",
    "{}",
]
odd_texts = st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=3), max_size=30).map("".join)
idents = st.from_regex(r"[a-z_][a-z0-9_]{0,6}", fullmatch=True)
SCHEMAS = {"get": {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}}}
FACTORIES: dict[str, Callable[[], ToolParser]] = {
    "llama3_json": Llama3JsonParser,
    "pythonic": PythonicParser,
    "qwen3_coder": Qwen3CoderParser.factory(SCHEMAS),
}


def stream(make: Callable[[], ToolParser], pieces: list[str]) -> tuple[str, list[ToolCall]]:
    parser, content, deltas = make(), "", []
    for i, piece in enumerate(pieces or [""]):
        out = parser.feed(piece, final=i == max(len(pieces), 1) - 1)
        content += out.content
        deltas.extend(out.calls)
    seen: set[int] = set()
    for d in deltas:  # index, id and name once, then argument fragments only
        if d.name is not None:
            assert d.index not in seen and d.id and d.id.startswith("call_") and d.arguments == ""
            seen.add(d.index)
        else:
            assert d.index in seen and d.id is None
    return content, assemble(deltas)


def whole(make: Callable[[], ToolParser], text: str) -> tuple[str | None, list[ToolCall]]:
    out = make().feed(text, final=True)
    return out.content or None, assemble(out.calls)


@FUZZ
@given(st.sampled_from(sorted(FACTORIES)), odd_texts, st.data())
def test_any_cut_equals_the_whole_and_nothing_raises(name: str, text: str, data: st.DataObject) -> None:
    whole_content, whole_calls = whole(FACTORIES[name], text)
    content, calls = stream(FACTORIES[name], cuts(text, data))
    assert (content or None) == whole_content
    assert strip_ids(calls) == strip_ids(whole_calls)


def _type(value: Any) -> str:
    return {str: "string", bool: "boolean", int: "integer", type(None): "null", list: "array", dict: "object"}[
        type(value)
    ]


def _qwen3(calls: list[tuple[str, dict[str, Any]]], sep: str) -> tuple[str, dict[str, dict[str, Any]]]:
    blocks, schemas = [], {}
    for k, (name, args) in enumerate(calls):
        fn = f"{name}{k}"  # one schema per call: the same key may hold another type in another call
        schemas[fn] = {"type": "object", "properties": {key: {"type": _type(v)} for key, v in args.items()}}
        params = "".join(
            f"<parameter={key}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
            for key, v in args.items()
        )
        blocks.append(f"<tool_call>\n<function={fn}>\n{params}</function>\n</tool_call>")
    return sep.join(blocks), schemas


arg_dicts = st.dictionaries(idents, json_values, max_size=3)
qwen_strings = st.text(alphabet='ab"\\{}[]:, \n\té=/', max_size=8)
qwen_values = json_values.filter(lambda v: not isinstance(v, str)) | qwen_strings


@FUZZ
@given(
    st.sampled_from(sorted(FACTORIES)),
    st.lists(st.tuples(idents, arg_dicts), min_size=1, max_size=3),
    st.sampled_from(["", "\n", " "]),
    st.booleans(),
    st.data(),
)
def test_well_formed_calls_are_read_back(
    name: str, calls: list[tuple[str, dict[str, Any]]], sep: str, tagged: bool, data: st.DataObject
) -> None:
    make = FACTORIES[name]
    want = [(n, a) for n, a in calls]
    if name == "llama3_json":
        text = ("<|python_tag|>" if tagged else "") + (";" + sep).join(
            json.dumps({"name": n, "parameters": a}) for n, a in calls
        )
    elif name == "pythonic":
        text = "[" + ("," + sep).join(f"{n}({', '.join(f'{k}={v!r}' for k, v in a.items())})" for n, a in calls) + "]"
    else:
        calls = [(n, {k: data.draw(qwen_values) for k in a}) for n, a in calls]
        text, schemas = _qwen3(calls, sep)
        text = ("Sure.\n" if tagged else "") + text
        want = [(f"{n}{k}", a) for k, (n, a) in enumerate(calls)]
        make = Qwen3CoderParser.factory(schemas)
    content, got = stream(make, cuts(text, data))
    assert [(c.name, json.loads(c.arguments)) for c in got] == want
    whole_content, whole_calls = whole(make, text)
    assert strip_ids(got) == strip_ids(whole_calls) and (content or None) == whole_content
    assert whole_content == ("Sure." if name == "qwen3_coder" and tagged else None)
