"""Anthropic Messages -> the chat path: messages, tools, refusals, stop reasons, the error shape, the formatter."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from server.families.anthropic.formatter import MessagesFormatter
from server.families.anthropic.messages import FRAMING
from server.families.anthropic.protocol import count_tokens_decoder, messages_decoder
from server.families.anthropic.translate import chat_request, decode_error, stop_reason
from server.http.errors import APIError
from server.http.errors import anthropic_error_body as error_body
from server.http.errors import anthropic_error_type as error_type
from server.reasoning.parser import get_reasoning_parser
from server.render.template_sandbox import render
from server.request.collector import Output
from server.request.openai_protocol import Usage
from server.structured.parsing import ChoiceParser
from server.tools.parser import HermesParser

WEATHER = {
    "name": "get_weather",
    "description": "Weather for a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}
USER = [{"role": "user", "content": "x"}]


def decode(**body: Any) -> Any:
    return messages_decoder.decode(json.dumps({"model": "m", "max_tokens": 5, **body}))


def refused(**body: Any) -> APIError:
    with pytest.raises(APIError) as e:
        chat_request(decode(**body))
    assert e.value.status == 400
    return e.value


def test_sampling_fields_and_system_string_map_onto_the_chat_request() -> None:
    chat = chat_request(
        decode(
            system="be brief",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            stop_sequences=["\n\n", "END"],
            temperature=0.5,
            top_p=0.9,
            top_k=40,
            metadata={"user_id": "u-1"},
            tool_choice={"type": "auto"},
            thinking={"type": "disabled"},
            output_config={"effort": "low"},
        )
    )
    assert chat.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert (chat.max_tokens, chat.stop, chat.temperature, chat.top_p, chat.top_k, chat.stream) == (
        5,
        ["\n\n", "END"],
        0.5,
        0.9,
        40,
        True,
    )
    assert chat.add_generation_prompt and not chat.continue_final_message and chat.tools is None


def test_system_blocks_and_text_blocks_join_like_openai_text_parts() -> None:
    chat = chat_request(
        decode(
            system=[
                {"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "b"},
            ],
            messages=[{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]}],
        )
    )
    assert chat.messages == [{"role": "system", "content": "a\nb"}, {"role": "user", "content": "x\ny"}]


def test_tool_use_and_tool_result_become_tool_calls_and_tool_messages() -> None:
    chat = chat_request(
        decode(
            tools=[WEATHER],
            tool_choice={"type": "none"},
            messages=[
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "use the tool", "signature": "sig"},
                        {"type": "text", "text": "Checking."},
                        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                        {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Lyon"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "22C"},
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_2",
                            "is_error": True,
                            "content": [{"type": "text", "text": "timeout"}],
                        },
                        {"type": "text", "text": "Thanks"},
                    ],
                },
            ],
        )
    )
    assert chat.messages == [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "use the tool",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                },
                {
                    "id": "toolu_2",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Lyon"}},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "name": "get_weather", "content": "22C"},
        {"role": "tool", "tool_call_id": "toolu_2", "name": "get_weather", "content": "Error: timeout"},  # is_error
        {"role": "user", "content": "Thanks"},
    ]
    assert chat.tools == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": WEATHER["input_schema"],
                "description": "Weather for a city",
            },
        }
    ]


def test_a_tool_aware_template_sees_tools_and_calls_in_the_openai_shape() -> None:
    template = (
        "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}{{ m.role }}:"
        "{{ m.content }}{% for c in m.tool_calls or [] %}<{{ c.function.name }} "
        "{{ c.function.arguments | tojson }}>{% endfor %};{% endfor %}"
    )
    chat = chat_request(
        decode(
            tools=[WEATHER],
            messages=[
                {"role": "user", "content": "q"},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}}],
                },
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "22C"}]},
            ],
        )
    )
    text = render(
        template,
        chat.messages or [],
        add_generation_prompt=True,
        continue_final_message=False,
        tools=chat.tools,
        documents=None,
        kwargs={},
        max_output_chars=1 << 20,
    )
    assert text == '[get_weather]user:q;assistant:<get_weather {"city": "Paris"}>;tool:22C;'


def test_a_final_assistant_message_is_a_prefill() -> None:
    chat = chat_request(decode(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]))
    assert chat.continue_final_message and not chat.add_generation_prompt


@pytest.mark.parametrize(
    "body, words, param",
    [
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "x"}}]}]},
            "images are not supported yet",
            "messages[0].content[0]",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image", "source": {}}]}
                        ],
                    }
                ]
            },
            "images are not supported yet",
            "messages[0].content[0].content[0]",
        ),
        (
            {"tool_choice": {"type": "tool"}, "tools": [WEATHER], "messages": USER},
            "needs the tool's name",
            "tool_choice.name",
        ),
        (
            {"thinking": {"type": "enabled", "budget_tokens": 1024}, "messages": [{"role": "user", "content": "x"}]},
            "start the server with --reasoning-parser",
            "thinking",
        ),
        ({"thinking": {"type": "adaptive"}, "messages": USER}, "--reasoning-parser", "thinking"),
        ({"thinking": {"type": "sometimes"}, "messages": USER}, "thinking.type must be", "thinking.type"),
        (
            {"output_config": {"format": {"type": "json_object"}}, "messages": USER},
            "json_schema",
            "output_config.format",
        ),
        (
            {
                "tools": [{"type": "web_search_20250305", "name": "web_search"}],
                "messages": [{"role": "user", "content": "x"}],
            },
            "server tools",
            "tools[0]",
        ),
        ({"tools": [{"name": "f"}], "messages": USER}, "input_schema", "tools[0].input_schema"),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
            "only appear in an assistant message",
            "messages[0].content[0]",
        ),
        (
            {"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]},
            "only appear in a user message",
            "messages[0].content[0]",
        ),
        ({"messages": []}, "at least one message", "messages"),
    ],
)
def test_what_is_not_supported_is_refused_naming_the_field(body: dict[str, Any], words: str, param: str) -> None:
    e = refused(**body)
    assert words in e.message and e.param == param


@pytest.mark.parametrize(
    "choice, openai_choice, parallel",
    [
        ({"type": "auto"}, None, None),  # the server's default: parsed with --enable-auto-tool-choice
        ({"type": "any"}, "required", None),
        ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
        ({"type": "tool", "name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}}, None),
        ({"type": "none"}, "none", None),
    ],
)
def test_tool_choice_maps_onto_openais(choice: dict[str, Any], openai_choice: Any, parallel: bool | None) -> None:
    chat = chat_request(decode(tools=[WEATHER], tool_choice=choice, messages=USER))
    assert chat.tool_choice == openai_choice and chat.parallel_tool_calls is parallel


def test_thinking_needs_a_reasoning_parser_and_a_budget_below_max_tokens() -> None:
    on = chat_request(
        decode(thinking={"type": "enabled", "budget_tokens": 1024}, messages=USER, max_tokens=2048), reasoning=True
    )
    assert on.chat_template_kwargs == {"enable_thinking": True}
    off = chat_request(decode(thinking={"type": "disabled"}, messages=USER))
    assert off.chat_template_kwargs == {"enable_thinking": False}
    for budget, max_tokens, param in [(1023, 4096, "thinking.budget_tokens"), (1024, 1024, "max_tokens")]:
        with pytest.raises(APIError) as e:
            chat_request(
                decode(thinking={"type": "enabled", "budget_tokens": budget}, messages=USER, max_tokens=max_tokens),
                reasoning=True,
            )
        assert e.value.param == param
    ok = chat_request(
        decode(thinking={"type": "enabled", "budget_tokens": 1024}, messages=USER, max_tokens=1025), reasoning=True
    )  # just over the budget
    assert ok.chat_template_kwargs == {"enable_thinking": True}


def test_output_config_format_becomes_a_json_schema_response_format() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = chat_request(decode(output_config={"format": {"type": "json_schema", "schema": schema}}, messages=USER))
    assert chat.response_format is not None and chat.response_format.type == "json_schema"
    assert chat.response_format.json_schema is not None and chat.response_format.json_schema.schema == schema


@pytest.mark.parametrize(
    "body, param",
    [
        (
            {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
            "messages[0].content[0].type",
        ),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
        ({"tool_choice": {"type": "sometimes"}, "messages": []}, "tool_choice.type"),
        ({"system": [{"type": "image", "source": {}}], "messages": []}, "system[0].type"),  # text blocks only
        ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
    ],
)
def test_malformed_bodies_are_400s_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(msgspec.ValidationError) as e:
        decode(**body)
    err = decode_error(e.value)
    assert err.status == 400 and err.param == param and "Anthropic Messages API reference" in err.message


def test_max_tokens_is_required_but_not_for_count_tokens() -> None:
    with pytest.raises(msgspec.ValidationError, match="max_tokens"):
        messages_decoder.decode(b'{"model": "m", "messages": [{"role": "user", "content": "x"}]}')
    req = count_tokens_decoder.decode(b'{"model": "m", "messages": [{"role": "user", "content": "x"}]}')
    assert chat_request(req).max_tokens is None


def test_stop_reasons() -> None:
    assert stop_reason("length", None) == ("max_tokens", None)
    assert stop_reason("stop", "END") == ("stop_sequence", "END")
    assert stop_reason("stop", 151645) == ("end_turn", None)  # a stop token: a natural end
    assert stop_reason("stop", None) == ("end_turn", None)


@pytest.mark.parametrize(
    "status, kind",
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (404, "not_found_error"),
        (413, "request_too_large"),
        (415, "invalid_request_error"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (503, "overloaded_error"),
        (529, "overloaded_error"),
        (502, "api_error"),
    ],
)
def test_error_types_by_status(status: int, kind: str) -> None:
    assert error_type(status) == kind
    assert json.loads(error_body(status, "why")) == {"type": "error", "error": {"type": kind, "message": "why"}}


def events(data: bytes) -> list[tuple[str, Any]]:
    out = []
    for block in data.decode().split("\n\n")[:-1]:
        kind, payload = block.split("\n")
        assert kind.startswith("event: ") and payload.startswith("data: ")
        out.append((kind[7:], json.loads(payload[6:])))
    return out


def test_formatter_writes_anthropics_event_sequence() -> None:
    fmt = MessagesFormatter("msg_x", "tiny", 7, None)
    start = events(fmt.stream_start())
    assert [k for k, _ in start] == ["message_start", "content_block_start", "ping"]
    assert start[0][1]["message"]["usage"] == {"input_tokens": 7, "output_tokens": 0}
    assert start[1][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert events(fmt.stream_chunk([Output(0, "Hé\n", [1], 1)], None) or b"") == [
        (
            "content_block_delta",
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hé\n"}},
        )
    ]
    assert fmt.stream_chunk([Output(0, "", [], 1)], None) is None  # nothing new: nothing sent
    end = events(fmt.stream_chunk([Output(0, "", [2], 2, "stop", "END")], None) or b"")
    assert end == [
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "stop_sequence", "stop_sequence": "END"},
                "usage": {"input_tokens": 7, "output_tokens": 2},
            },
        ),
        ("message_stop", {"type": "message_stop"}),
    ]
    assert FRAMING.done == b"" and events(FRAMING.keepalive) == [("ping", {"type": "ping"})]
    assert events(FRAMING.error(APIError("engine died", status=500))) == [
        ("error", {"type": "error", "error": {"type": "api_error", "message": "engine died"}})
    ]


def test_final_message_shape() -> None:
    fmt = MessagesFormatter("msg_x", "tiny", 7, None)
    body = json.loads(fmt.final([Output(0, "Hello", [1, 2, 3], 3, "length")], Usage(7, 3, 10)))
    assert body == {
        "type": "message",
        "id": "msg_x",
        "role": "assistant",
        "model": "tiny",
        "content": [{"type": "text", "text": "Hello"}],
        "stop_reason": "max_tokens",
        "stop_sequence": None,
        "usage": {"input_tokens": 7, "output_tokens": 3},
    }


def test_an_empty_stream_still_has_one_text_block() -> None:
    fmt = parsed()  # with a parser, blocks open as the text decides: none was opened
    assert [k for k, _ in events(fmt.stream_start())] == ["message_start", "ping"]
    end = events(fmt.stream_chunk([Output(0, "", [2], 1, "length")], None) or b"")
    assert [k for k, _ in end] == ["content_block_start", "content_block_stop", "message_delta", "message_stop"]


def parsed(tools: bool = True, reasoning: bool = False) -> MessagesFormatter:
    parser = ChoiceParser(
        get_reasoning_parser("deepseek_r1")(None) if reasoning else None, HermesParser() if tools else None
    )
    return MessagesFormatter("msg_x", "tiny", 7, parser)


ANSWER = (
    '<think>Paris is a city.</think>Let me check.<tool_call>\n{"name": "get_weather", "arguments": '
    '{"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}'
    "\n</tool_call>"
)


def assemble_stream(fmt: MessagesFormatter, pieces: list[str]) -> tuple[list[dict[str, Any]], str]:
    """What the SDK's stream accumulator builds: blocks by index, deltas appended, partial JSON parsed."""
    blocks: dict[int, dict[str, Any]] = {}
    json_parts: dict[int, str] = {}
    stop = ""
    chunks = [fmt.stream_chunk([Output(0, p, [1], i + 1)], None) for i, p in enumerate(pieces)]
    chunks.append(fmt.stream_chunk([Output(0, "", [2], len(pieces) + 1, "stop")], None))
    for kind, data in events(b"".join(c for c in chunks if c)):
        if kind == "content_block_start":
            assert data["index"] == len(blocks)  # indexes count up from 0, one block at a time
            blocks[data["index"]] = dict(data["content_block"])
        elif kind == "content_block_delta":
            block, delta = blocks[data["index"]], data["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            else:
                assert delta["type"] == "input_json_delta"
                json_parts[data["index"]] = json_parts.get(data["index"], "") + delta["partial_json"]
        elif kind == "message_delta":
            stop = data["delta"]["stop_reason"]
    for i, text in json_parts.items():
        blocks[i]["input"] = json.loads(text)
    return [blocks[i] for i in sorted(blocks)], stop


@pytest.mark.parametrize("cut", [1, 2, 3, 7, len(ANSWER)])
def test_tool_use_and_thinking_blocks_streamed_equal_the_final_message(cut: int) -> None:
    final = json.loads(parsed(reasoning=True).final([Output(0, ANSWER, [1], 9, "stop")], Usage(7, 9, 16)))
    assert final["stop_reason"] == "tool_use"
    content = final["content"]
    assert [b["type"] for b in content] == ["thinking", "text", "tool_use", "tool_use"]
    assert content[0] == {"type": "thinking", "thinking": "Paris is a city.", "signature": ""}
    assert content[1] == {"type": "text", "text": "Let me check."}
    assert [(b["name"], b["input"]) for b in content[2:]] == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Rome"}),
    ]
    assert all(b["id"].startswith("toolu_") and len(b["id"]) == 30 for b in content[2:])
    blocks, stop = assemble_stream(parsed(reasoning=True), [ANSWER[i : i + cut] for i in range(0, len(ANSWER), cut)])
    assert stop == "tool_use"
    strip = [{k: v for k, v in b.items() if k != "id"} for b in content]
    assert [{k: v for k, v in b.items() if k != "id"} for b in blocks] == strip


def test_a_call_whose_arguments_are_not_an_object_stays_text() -> None:
    body = json.loads(
        parsed().final(
            [Output(0, '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>', [1], 3, "stop")], Usage(7, 3, 10)
        )
    )
    assert all(b["type"] == "text" for b in body["content"])


# ------------------------------------------------------- tool_use / tool_result pairing (Anthropic's 400s)

USE = {
    "role": "assistant",
    "content": [{"type": "tool_use", "id": "toolu_a", "name": "get_weather", "input": {"city": "Paris"}}],
}


def _result(use_id: str) -> dict[str, Any]:
    return {"type": "tool_result", "tool_use_id": use_id, "content": "22C"}


@pytest.mark.parametrize(
    "messages, words, param",
    [
        (
            [{"role": "user", "content": [_result("toolu_x")]}],
            "unexpected `tool_use_id` found in `tool_result` blocks: toolu_x",
            "messages[0].content[0]",
        ),  # no assistant turn before it at all
        (
            [*USER, USE, {"role": "user", "content": [_result("toolu_a"), _result("toolu_b")]}],
            "unexpected `tool_use_id` found in `tool_result` blocks: toolu_b",
            "messages[2].content[1]",
        ),
        (
            [*USER, USE, {"role": "user", "content": "what now?"}],
            "`tool_use` ids were found without `tool_result` blocks immediately after: toolu_a",
            "messages[1]",
        ),
        (
            [*USER, USE, {"role": "user", "content": [{"type": "text", "text": "what now?"}]}],
            "without `tool_result` blocks immediately after: toolu_a",
            "messages[1]",
        ),
        (
            [
                *USER,
                USE,
                {"role": "user", "content": [_result("toolu_a")]},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": [_result("toolu_a")]},
            ],  # answered once; the second answers no tool_use before it
            "unexpected `tool_use_id` found in `tool_result` blocks: toolu_a",
            "messages[4].content[0]",
        ),
    ],
)
def test_tool_results_must_answer_the_previous_turns_tool_uses(messages: list[Any], words: str, param: str) -> None:
    e = refused(tools=[WEATHER], messages=messages)
    assert words in e.message and e.param == param and e.status == 400


def test_paired_tool_results_and_a_final_tool_use_prefill_pass() -> None:
    chat_request(decode(tools=[WEATHER], messages=[*USER, USE, {"role": "user", "content": [_result("toolu_a")]}]))
    chat_request(decode(tools=[WEATHER], messages=[*USER, USE]))  # a prefill: nothing after it to answer it yet
