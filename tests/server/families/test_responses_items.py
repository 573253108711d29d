"""Responses API input items -> chat messages (server/families/responses/items.py): each item kind, the order
of turns, and a 400 naming the field for what cannot be honoured."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from server.families.responses.items import chat_messages, chat_request, responses_error
from server.families.responses.protocol import ResponsesRequest, responses_decoder
from server.http.errors import APIError


def req(**kw: Any) -> ResponsesRequest:
    return responses_decoder.decode(msgspec.json.encode({"model": "tiny", **kw}))


CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_a_string_is_one_user_turn_after_the_instructions() -> None:
    chat = chat_request(
        req(
            input="hi",
            instructions="be brief",
            max_output_tokens=5,
            temperature=0.5,
            top_p=0.9,
            seed=3,
            stop=["x"],
            stream=True,
        ),
        [],
    )
    assert chat.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert (chat.max_tokens, chat.temperature, chat.top_p, chat.seed, chat.stop, chat.stream) == (
        5,
        0.5,
        0.9,
        3,
        ["x"],
        True,
    )


def test_message_items_and_parts() -> None:
    items = [
        {"role": "developer", "content": "rules"},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
        },
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "c", "annotations": []}]},
    ]
    assert chat_messages(None, items) == [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "c"},
    ]


def test_an_earlier_output_becomes_one_assistant_turn_with_its_calls_and_results() -> None:
    items = [
        {"role": "user", "content": "weather?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        CALL,
        {**CALL, "call_id": "call_2", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "22C"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "18C"}]},
    ]
    assert chat_messages(None, items) == [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "think",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                },
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Rome"}},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "22C"},
        {"role": "tool", "tool_call_id": "call_2", "name": "get_weather", "content": "18C"},
    ]


def test_history_comes_before_the_input_and_calls_in_it_can_be_answered() -> None:
    chat = chat_request(
        req(input=[{"type": "function_call_output", "call_id": "call_1", "output": "22C"}]),
        [{"role": "user", "content": "weather?"}, CALL],
    )
    assert chat.messages is not None and [m["role"] for m in chat.messages] == ["user", "assistant", "tool"]


def test_tools_tool_choice_and_text_format() -> None:
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}
    chat = chat_request(
        req(
            input="hi",
            tools=[tool],
            tool_choice={"type": "function", "name": "f"},
            parallel_tool_calls=False,
            text={"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}}},
        ),
        [],
    )
    assert chat.tools == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "strict": True}}
    ]
    assert chat.tool_choice == {"type": "function", "function": {"name": "f"}} and chat.parallel_tool_calls is False
    assert chat.response_format is not None and chat.response_format.json_schema is not None
    assert chat.response_format.json_schema.schema == {"type": "object"}
    assert chat_request(req(input="hi", tool_choice="required"), []).tool_choice == "required"
    plain = chat_request(req(input="hi", text={"format": {"type": "text"}}), [])
    assert plain.response_format is None
    assert chat_request(req(input="hi", text={"format": {"type": "json_object"}}), []).response_format is not None


@pytest.mark.parametrize(
    "kw, param",
    [
        ({}, "input"),
        ({"input": []}, "input"),
        ({"input": [{"role": "system", "content": "only rules"}]}, "input"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": [{"role": "user", "content": 3}]}, "input[0].content"),
        ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0].text"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:x"}]}]},
            "input[0].content[0]",
        ),
        ({"input": [{**CALL, "call_id": ""}]}, "input[0].call_id"),
        ({"input": [{**CALL, "name": None}]}, "input[0].name"),
        ({"input": [{**CALL, "arguments": {"city": "Paris"}}]}, "input[0].arguments"),
        (
            {
                "input": [
                    {"role": "user", "content": "x"},
                    {"type": "function_call_output", "call_id": "c", "output": ""},
                ]
            },
            "input[1].call_id",
        ),
        ({"input": "hi", "tools": [{"type": "file_search"}]}, "tools[0].type"),
        ({"input": "hi", "tools": [{"type": "function"}]}, "tools[0].name"),
        ({"input": "hi", "tool_choice": {"type": "function"}}, "tool_choice"),
        ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format"),
        ({"input": "hi", "include": ["file_search_call.results"]}, "include"),
        ({"input": "hi", "truncation": "middle"}, "truncation"),
        ({"input": "hi", "background": True, "store": False}, "background"),
        ({"input": "hi", "background": True, "stream": True}, "stream"),
        ({"input": "hi", "conversation": "conv_1", "previous_response_id": "resp_1"}, "conversation"),
        ({"input": "hi", "prompt": {"id": "pmpt_1"}}, "prompt"),
    ],
)
def test_400s_name_the_field(kw: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as e:
        chat_request(req(**kw), [])
    assert e.value.status == 400 and e.value.param == param


def test_an_input_image_on_a_vision_model_is_an_image_url_part() -> None:
    items = [
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": "what?"},
                {"type": "input_image", "image_url": "data:image/png;base64,AA"},
            ],
        }
    ]
    assert chat_messages(None, items, images=True) == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "what?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}},
            ],
        }
    ]


def test_chat_errors_name_the_responses_field() -> None:
    e = responses_error(APIError("max_tokens must be at least 1", param="max_tokens"))
    assert (e.param, e.message) == ("max_output_tokens", "max_output_tokens must be at least 1")
    assert responses_error(APIError("x", param="messages.0")).param == "input.0"
    assert responses_error(APIError("x", param="seed")).param == "seed"
