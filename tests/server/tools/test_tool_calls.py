"""server/tools/: tool_choice plans and constraints, the parsers, and the chat formatter on hand-built token streams
(the random model never writes a call on its own: `auto` is tested here, not end to end)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from engine.structured.grammar import validate
from server.families.openai.formatter import ParsedChatFormatter
from server.http.errors import APIError
from server.request.collector import Output
from server.request.detokenizer import IncrementalDetokenizer
from server.request.openai_protocol import Usage
from server.structured.parsing import added_token_ids
from server.tools.choice import AUTO_NEEDS_FLAGS, plan_tools
from server.tools.parser import HermesParser, JsonListParser, MistralParser, NamedArgsParser

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}, "n": {"type": "integer"}}, "required": ["city"]}
TOOLS: Any = [
    {"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}},
    {"type": "function", "function": {"name": "noop"}},
]
IDS = {"<tool_call>": 151657, "</tool_call>": 151658}.get


def plan(tool_choice: Any, parser: str | None = "hermes", auto: bool = True, tools: Any = TOOLS) -> Any:
    return plan_tools(tools, tool_choice, parser_name=parser, enable_auto=auto, token_id=IDS)


# ------------------------------------------------------------------------------------------------- plans


@pytest.mark.parametrize(
    "tools, choice, parser, auto, needle",
    [
        (None, "required", "hermes", True, "`tools` must be set"),
        (None, {"type": "function", "function": {"name": "x"}}, None, False, "`tools` must be set"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "hermes", True, "does not match any"),
        (TOOLS, "auto", None, False, AUTO_NEEDS_FLAGS),
        (TOOLS, "auto", "hermes", False, AUTO_NEEDS_FLAGS),
        (TOOLS, "whenever", "hermes", True, "tool_choice must be"),
        (TOOLS, {"type": "function"}, "hermes", True, "tool_choice must be"),
        ([{"type": "function", "function": {"parameters": {}}}], "required", "hermes", True, "name must be"),
    ],
)
def test_400s(tools: Any, choice: Any, parser: str | None, auto: bool, needle: str) -> None:
    with pytest.raises(APIError) as e:
        plan(choice, parser, auto, tools)
    assert e.value.status == 400 and needle in str(e.value.message)


def test_defaults() -> None:
    assert plan(None, tools=None) is None
    assert plan(None).mode == "auto"  # OpenAI's default with tools, when the server allows it
    assert plan(None, auto=False).mode == "none"  # tools rendered, nothing parsed
    assert plan("none").parser is None and plan("none").constraint is None
    assert plan("auto").constraint is None and plan("auto").parser is HermesParser


@pytest.mark.parametrize("parser", ["hermes", "mistral", None])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_choices_build_constraints_the_backend_compiles(parser: str | None, choice: Any) -> None:
    p = plan(choice, parser)
    assert p.constraint is not None and validate(p.constraint) is None, p.constraint
    if parser == "hermes":
        assert p.constraint.kind == "grammar" and "<[151657]>" in p.constraint.spec  # the tag by token id
    if parser is None:
        assert p.constraint.kind == "json"
        assert p.parser is JsonListParser or isinstance(p.parser(), NamedArgsParser)
    if parser == "mistral":
        assert p.skip_special_tokens is False  # [TOOL_CALLS] is a control token


def test_without_the_tag_token_the_grammar_spells_it() -> None:
    p = plan_tools(TOOLS, "required", parser_name="hermes", enable_auto=True, token_id=lambda t: None)
    assert '"<tool_call>"' in p.constraint.spec and validate(p.constraint) is None


def test_named_without_parser_streams_the_whole_output_as_arguments() -> None:
    p = plan({"type": "function", "function": {"name": "get_weather"}}, None)
    parser = p.parser()
    a, b = parser.feed('{"city":'), parser.feed(' "Rome"}', final=True)
    assert a.calls[0].name == "get_weather" and a.calls[0].id.startswith("call_")
    assert "".join(d.arguments for d in a.calls + b.calls) == '{"city": "Rome"}'


# ----------------------------------------------------------------------------------------------- parsers


def test_hermes_content_calls_and_odd_blocks() -> None:
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "a}\\"b", "n": 2}}\n'
        '</tool_call>\n<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>'
    )
    content, calls = HermesParser.extract(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": 'a}"b', "n": 2}),
        ("noop", {}),
    ]
    assert HermesParser.extract("<tool_call>not json</tool_call> hi") == ("<tool_call>not json</tool_call> hi", [])
    assert HermesParser.extract("plain text") == ("plain text", [])
    truncated = HermesParser.extract('<tool_call>\n{"name": "f", "arguments": {"a": [1, ')
    assert [(c.name, c.arguments) for c in truncated[1]] == [("f", '{"a": [1, ')]  # cut: kept as far as it got
    assert HermesParser.extract('<tool_call>{"name": "f"}</tool_call>')[1][0].arguments == "{}"
    assert (
        HermesParser.extract('<tool_call>{"arguments": {"x": 1}, "name": "f"}</tool_call>')[1][0].arguments
        == '{"x": 1}'
    )  # arguments before the name


def test_mistral_ids_and_list() -> None:
    content, calls = MistralParser.extract(
        '[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]'
    )
    assert content is None and [c.name for c in calls] == ["a", "b"]
    assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)


# ------------------------------------------------------------------- the formatter on hand-built token streams


@pytest.fixture(scope="module")
def qwen25() -> Any:
    import tokenizers

    from demo.tokenizers import tokenizer_dir

    return tokenizers.Tokenizer.from_file(str(tokenizer_dir("qwen2.5") / "tokenizer.json"))


def sse_json(chunk: bytes | None) -> list[dict[str, Any]]:
    if not chunk:
        return []
    return [json.loads(line[6:]) for line in chunk.decode().split("\n\n") if line.startswith("data: {")]


def run_stream(
    tok: Any, ids: list[int], step: int, tools: Any, reasoning: str | None = None, prompt: str = ""
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Feed `ids` `step` at a time through the detokenizer and the formatter: (stream deltas, final message)."""
    detok = IncrementalDetokenizer(tok, [])
    fmt = ParsedChatFormatter("chatcmpl-x", 0, "m", 1, None, False, tools=tools, reasoning=reasoning, prompt=prompt)
    chunks: list[dict[str, Any]] = []
    for start in range(0, len(ids), step):
        part = ids[start : start + step]
        last = start + step >= len(ids)
        if last:
            detok.update(part, True)
            text = detok.take_delta()
        else:
            text = detok.next_delta(part)
        out = Output(0, text, part, start + len(part), "stop" if last else None)
        chunks += sse_json(fmt.stream_chunk([out], None))
    fmt2 = ParsedChatFormatter("chatcmpl-x", 0, "m", 1, None, False, tools=tools, reasoning=reasoning, prompt=prompt)
    final = json.loads(
        fmt2.final([Output(0, tok.decode(ids, skip_special_tokens=True), ids, len(ids), "stop")], Usage(1, 1, 2))
    )
    return chunks, final


def assemble_sdk(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """What the openai SDK's stream helpers build: content, reasoning and calls by index."""
    content, reasoning, calls, finish = "", "", {}, None
    for c in chunks:
        choice = c["choices"][0]
        delta = choice["delta"]
        content += delta.get("content") or ""
        reasoning += delta.get("reasoning") or ""
        assert delta.get("reasoning") == delta.get("reasoning_content")
        for tc in delta.get("tool_calls") or []:
            call = calls.setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in tc:
                assert call["id"] is None
                call["id"] = tc["id"]
            if "name" in tc["function"]:
                assert call["name"] is None
                call["name"] = tc["function"]["name"]
            call["arguments"] += tc["function"]["arguments"]
        finish = choice["finish_reason"] or finish
    return {
        "content": content or None,
        "reasoning": reasoning or None,
        "calls": [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)],
        "finish": finish,
    }


OUTPUTS = [
    'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "n": 3}}\n</tool_call>'
    '\n<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>',
    "No tools needed: 2 < 3 and {braces} stay.",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "unterminated',
]


@pytest.mark.parametrize("text", OUTPUTS)
@pytest.mark.parametrize("step", [1, 2, 5])
def test_auto_stream_assembles_to_the_final_message(qwen25: Any, text: str, step: int) -> None:
    ids = qwen25.encode(text, add_special_tokens=False).ids
    assert (151657 in ids) == ("<tool_call>" in text)  # the tag is one token, as the model writes it
    chunks, final = run_stream(qwen25, ids, step, plan("auto"))
    got = assemble_sdk(chunks)
    message = final["choices"][0]["message"]
    assert got["content"] == message["content"]
    assert got["calls"] == [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    assert got["finish"] == final["choices"][0]["finish_reason"]
    assert all("<tool_call>" not in (c["choices"][0]["delta"].get("content") or "") for c in chunks)
    if message["tool_calls"]:
        assert final["choices"][0]["finish_reason"] == "tool_calls"
        assert all(c["id"].startswith("call_") and c["type"] == "function" for c in message["tool_calls"])


def test_reasoning_then_tool_call(qwen25: Any) -> None:
    text = 'I should look.</think>\n\n<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>'
    ids = qwen25.encode(text, add_special_tokens=False).ids
    for step in (1, 3):
        chunks, final = run_stream(qwen25, ids, step, plan("auto"), "qwen3", prompt="<|im_start|>assistant\n<think>\n")
        got = assemble_sdk(chunks)
        message = final["choices"][0]["message"]
        assert message["reasoning"] == message["reasoning_content"] == got["reasoning"] == "I should look."
        assert message["content"] is None and got["content"] is None
        assert (
            got["calls"]
            == [("noop", "{}")]
            == [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
        )


def test_added_token_ids(qwen25: Any) -> None:
    ids = added_token_ids(qwen25)
    assert ids("<tool_call>") == 151657 and ids("</tool_call>") == 151658 and ids("hello") is None
