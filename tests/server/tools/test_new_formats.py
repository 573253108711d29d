"""llama3_json, pythonic and qwen3_coder: whole texts, every split point, the chat formatter at stream
intervals 1, 2 and 5, and the tool_choice grammars (compiled, and accepting what the parser reads back)."""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

import llguidance
import pytest

from engine.structured.grammar import to_grammar, validate
from server.tools.choice import plan_tools
from server.tools.llama3 import Llama3JsonParser
from server.tools.parser import ToolCall, ToolParser, assemble
from server.tools.parser_names import template_fits
from server.tools.pythonic import PythonicParser
from server.tools.qwen3_coder import Qwen3CoderParser
from tests.server.tools.test_mistral_args import byte_tokenizer
from tests.server.tools.test_tool_calls import assemble_sdk, qwen25, run_stream  # noqa: F401 - a fixture

PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "n": {"type": "integer"}, "hot": {"type": "boolean"}},
    "required": ["city"],
}
TOOLS: Any = [
    {"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}},
    {"type": "function", "function": {"name": "noop"}},
]
FUNCTIONS = {"get_weather": PARAMS, "noop": {"type": "object", "properties": {}}}
PARSERS: dict[str, Any] = {
    "llama3_json": Llama3JsonParser,
    "pythonic": PythonicParser,
    "qwen3_coder": Qwen3CoderParser.factory(FUNCTIONS),
}
WEATHER = ("get_weather", {"city": 'Zü"rich', "n": 3})

# name -> [(text, content, [(name, arguments)])]
CASES: dict[str, list[tuple[str, str | None, list[tuple[str, Any]]]]] = {
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Zü\\"rich", "n": 3}}', None, [WEATHER]),
        (
            '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Zü\\"rich", "n": 3}}; '
            '{"name": "noop", "parameters": {}}',
            None,
            [WEATHER, ("noop", {})],
        ),
        ('{"name": "noop", "arguments": {}}', None, [("noop", {})]),
        ('{"name": "noop"}', None, [("noop", {})]),
        ("Plain text {with braces}.", "Plain text {with braces}.", []),
        ('{"answer": 42}', '{"answer": 42}', []),
        ("<|python_tag|>print(1)", "print(1)", []),
    ],
    "pythonic": [
        ("[get_weather(city='Zü\"rich', n=3)]", None, [WEATHER]),
        ('[get_weather(city="Zü\\"rich", n=3), noop()]', None, [WEATHER, ("noop", {})]),
        (
            "<|python_start|>[get_weather(city='x', n=-1, hot=True, more=[1, None, {'a': false}])]<|python_end|>",
            None,
            [("get_weather", {"city": "x", "n": -1, "hot": True, "more": [1, None, {"a": False}]})],
        ),
        ("[link](https://example.com) is a link.", "[link](https://example.com) is a link.", []),
        ("[1, 2, 3]", "[1, 2, 3]", []),
        ("No calls here.", "No calls here.", []),
    ],
    "qwen3_coder": [
        (
            'Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nZü"rich\n</parameter>\n'
            "<parameter=n>\n3\n</parameter>\n</function>\n</tool_call>",
            "Let me check.",
            [WEATHER],
        ),
        (
            "<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n<parameter=hot>\nfalse\n"
            "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=noop>\n</function>\n</tool_call>",
            None,
            [("get_weather", {"city": "42", "hot": False}), ("noop", {})],
        ),
        (
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nline one\nline two\n\n</parameter>\n</function>"
            "\n</tool_call>",
            None,
            [("get_weather", {"city": "line one\nline two\n"})],
        ),
        ("<tool_call>not a function</tool_call> ok", "<tool_call>not a function</tool_call> ok", []),
        ("x < y and <tool text", "x < y and <tool text", []),
    ],
}
ALL = [(name, *case) for name, cases in CASES.items() for case in cases]


def streamed(name: str, pieces: list[str]) -> tuple[str, list[ToolCall]]:
    parser: ToolParser = PARSERS[name]()
    content, deltas = "", []
    for k, piece in enumerate(pieces):
        out = parser.feed(piece, final=k == len(pieces) - 1)
        content += out.content
        deltas += out.calls
    return content, assemble(deltas)


def key(calls: list[ToolCall]) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize("name, text, content, calls", ALL)
def test_whole_text_and_every_split_point(
    name: str, text: str, content: str | None, calls: list[tuple[str, Any]]
) -> None:
    whole = streamed(name, [text])
    assert (whole[0] or None) == content
    assert [(c.name, json.loads(c.arguments)) for c in whole[1]] == calls
    assert all(c.id.startswith("call_") for c in whole[1])
    for cut in range(len(text) + 1):
        got = streamed(name, [text[:cut], text[cut:]])
        assert (got[0], key(got[1])) == (whole[0], key(whole[1])), cut
    got = streamed(name, list(text))
    assert (got[0], key(got[1])) == (whole[0], key(whole[1]))


def test_cut_by_max_tokens_keeps_what_was_written() -> None:
    assert key(streamed("pythonic", ["[get_weather(city='Zür"])[1]) == [("get_weather", '{"city": "Zür')]
    assert key(streamed("qwen3_coder", ["<tool_call>\n<function=get_weather>\n<parameter=city>\nRo"])[1]) == [
        ("get_weather", '{"city": "Ro')
    ]
    assert key(streamed("llama3_json", ['{"name": "noop", "parameters": {"a": [1, '])[1]) == [("noop", '{"a": [1, ')]


@pytest.mark.parametrize("name, text, content, calls", [c for c in ALL if c[3]])
@pytest.mark.parametrize("step", [1, 2, 5])
def test_stream_intervals_assemble_to_the_final_message(
    qwen25: Any,  # noqa: F811 - the fixture imported from test_tool_calls
    name: str,
    text: str,
    content: str | None,
    calls: list[tuple[str, Any]],
    step: int,
) -> None:
    tool_plan = plan_tools(TOOLS, "auto", parser_name=name, enable_auto=True, token_id=lambda t: None)
    ids = qwen25.encode(text, add_special_tokens=False).ids
    chunks, final = run_stream(qwen25, ids, step, tool_plan)
    got = assemble_sdk(chunks)
    message = final["choices"][0]["message"]
    assert got["content"] == message["content"] == content
    assert got["calls"] == [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    assert [(n, json.loads(a)) for n, a in got["calls"]] == calls
    assert got["finish"] == final["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("name", sorted(PARSERS))
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_grammar_accepts_what_the_parser_reads(name: str, choice: Any) -> None:
    tags = {"<tool_call>": 256, "</tool_call>": 257}
    tool_plan = plan_tools(TOOLS, choice, parser_name=name, enable_auto=True, token_id=tags.get)
    so = tool_plan.constraint
    assert so is not None and validate(so) is None, so.spec
    written = {
        "llama3_json": '{"name": "get_weather", "parameters": {"city": "Rome", "n": 2}}',
        "pythonic": '[get_weather(city="Rome", n=2)]',
        "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
        "<parameter=n>\n2\n</parameter>\n</function>\n</tool_call>",
    }[name]
    tok = byte_tokenizer({i: t for t, i in tags.items()})
    ids: list[int] = []
    for piece in (
        written.replace("</tool_call>", "\0</tool_call>\0").replace("<tool_call>", "\0<tool_call>\0").split("\0")
    ):
        ids += [tags[piece]] if piece in tags else tok.tokenize_str(piece)
    matcher = llguidance.LLMatcher(tok, to_grammar(so), log_level=0)
    assert matcher.consume_tokens(ids), matcher.get_error()
    assert matcher.is_accepting() or matcher.is_stopped()
    calls = assemble(tool_plan.parser().feed(written, final=True).calls)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Rome", "n": 2})]
    if choice == "required":  # two calls where parallel calls are allowed
        two = {
            "llama3_json": written + "; " + '{"name": "noop", "parameters": {}}',
            "pythonic": '[get_weather(city="Rome", n=2), noop()]',
            "qwen3_coder": written + "\n<tool_call>\n<function=noop>\n</function>\n</tool_call>",
        }[name]
        matcher = llguidance.LLMatcher(tok, to_grammar(so), log_level=0)
        ids = []
        for piece in (
            two.replace("</tool_call>", "\0</tool_call>\0").replace("<tool_call>", "\0<tool_call>\0").split("\0")
        ):
            ids += [tags[piece]] if piece in tags else tok.tokenize_str(piece)
        assert matcher.consume_tokens(ids), matcher.get_error()


@pytest.mark.parametrize(
    "name, fits",
    [("hermes", True), ("qwen3_coder", False), ("pythonic", False), ("llama3_json", False), ("mistral", False)],
)
def test_a_parser_the_template_does_not_teach_is_warned_about(
    name: str, fits: bool, tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """One log line at start-up when none of the parser's markers is in the chat template (Qwen2.5's here)."""
    from demo.tokenizers import tokenizer_dir
    from server.app_load import _warn_tool_parser_misfit
    from server.config import OutputConfig, ServerConfig

    template = json.loads((tokenizer_dir("qwen2.5") / "tokenizer_config.json").read_text())["chat_template"]
    (tmp_path / "t.jinja").write_text(template)
    config = dataclasses.replace(ServerConfig(), outputs=OutputConfig(tool_call_parser=name))
    config = dataclasses.replace(
        config, model=dataclasses.replace(config.model, chat_template=str(tmp_path / "t.jinja"))
    )
    with caplog.at_level(logging.WARNING, "spindle.server"):
        _warn_tool_parser_misfit(config)
    lines = [r for r in caplog.records if "tool-call markers" in r.getMessage()]
    assert len(lines) == (0 if fits else 1)
    assert template_fits(name, template) == fits and template_fits(name, None)
