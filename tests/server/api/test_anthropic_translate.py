"""Anthropic Messages -> the chat path: messages, tools, refusals, stop reasons, the error shape, the formatter."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from server.api.anthropic.messages import FRAMING, MessagesFormatter
from server.api.anthropic.translate import chat_request, decode_error, stop_reason
from server.http.errors import APIError
from server.pipeline.output_processor import Output
from server.protocol.anthropic import count_tokens_decoder, error_body, error_type, messages_decoder
from server.protocol.openai import Usage
from server.render.template_sandbox import render

WEATHER = {"name": "get_weather", "description": "Weather for a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
USER = [{"role": "user", "content": "x"}]


def decode(**body: Any) -> Any:
    return messages_decoder.decode(json.dumps({"model": "m", "max_tokens": 5, **body}))


def refused(**body: Any) -> APIError:
    with pytest.raises(APIError) as e:
        chat_request(decode(**body))
    assert e.value.status == 400
    return e.value


def test_sampling_fields_and_system_string_map_onto_the_chat_request() -> None:
    chat = chat_request(decode(system="be brief", messages=[{"role": "user", "content": "hi"}], stream=True,
                               stop_sequences=["\n\n", "END"], temperature=0.5, top_p=0.9, top_k=40,
                               metadata={"user_id": "u-1"}, tool_choice={"type": "auto"},
                               thinking={"type": "disabled"}, output_config={"effort": "low"}))
    assert chat.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert (chat.max_tokens, chat.stop, chat.temperature, chat.top_p, chat.top_k, chat.stream) == (
        5, ["\n\n", "END"], 0.5, 0.9, 40, True)
    assert chat.add_generation_prompt and not chat.continue_final_message and chat.tools is None


def test_system_blocks_and_text_blocks_join_like_openai_text_parts() -> None:
    chat = chat_request(decode(system=[{"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}},
                                       {"type": "text", "text": "b"}],
                               messages=[{"role": "user", "content": [{"type": "text", "text": "x"},
                                                                      {"type": "text", "text": "y"}]}]))
    assert chat.messages == [{"role": "system", "content": "a\nb"}, {"role": "user", "content": "x\ny"}]


def test_tool_use_and_tool_result_become_tool_calls_and_tool_messages() -> None:
    chat = chat_request(decode(tools=[WEATHER], tool_choice={"type": "none"}, messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "use the tool", "signature": "sig"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "22C"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
             "content": [{"type": "text", "text": "timeout"}]},
            {"type": "text", "text": "Thanks"}]}]))
    assert chat.messages == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "use the tool",
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "name": "get_weather", "content": "22C"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: timeout"},  # is_error: visible to the model
        {"role": "user", "content": "Thanks"}]
    assert chat.tools == [{"type": "function", "function": {
        "name": "get_weather", "parameters": WEATHER["input_schema"], "description": "Weather for a city"}}]


def test_a_tool_aware_template_sees_tools_and_calls_in_the_openai_shape() -> None:
    template = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}{{ m.role }}:"
                "{{ m.content }}{% for c in m.tool_calls or [] %}<{{ c.function.name }} "
                "{{ c.function.arguments | tojson }}>{% endfor %};{% endfor %}")
    chat = chat_request(decode(tools=[WEATHER], messages=[
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "22C"}]}]))
    text = render(template, chat.messages or [], add_generation_prompt=True, continue_final_message=False,
                  tools=chat.tools, documents=None, kwargs={}, max_output_chars=1 << 20)
    assert text == '[get_weather]user:q;assistant:<get_weather {"city": "Paris"}>;tool:22C;'


def test_a_final_assistant_message_is_a_prefill() -> None:
    chat = chat_request(decode(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]))
    assert chat.continue_final_message and not chat.add_generation_prompt


@pytest.mark.parametrize("body, words, param", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "x"}}]}]},
     "images are not supported yet", "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "image", "source": {}}]}]}]}, "images are not supported yet", "messages[0].content[0].content[0]"),
    ({"tool_choice": {"type": "any"}, "tools": [WEATHER], "messages": [{"role": "user", "content": "x"}]},
     "forced tool use", "tool_choice"),
    ({"tool_choice": {"type": "tool", "name": "get_weather"}, "tools": [WEATHER],
      "messages": [{"role": "user", "content": "x"}]}, "forced tool use", "tool_choice"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}, "messages": [{"role": "user", "content": "x"}]},
     "thinking of type 'enabled' is not supported yet", "thinking"),
    ({"thinking": {"type": "adaptive"}, "messages": USER}, "not supported yet", "thinking"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {}}}, "messages": USER},
     "structured outputs", "output_config.format"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}], "messages": [{"role": "user", "content": "x"}]},
     "server tools", "tools[0]"),
    ({"tools": [{"name": "f"}], "messages": USER}, "input_schema", "tools[0].input_schema"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     "only appear in an assistant message", "messages[0].content[0]"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]},
     "only appear in a user message", "messages[0].content[0]"),
    ({"messages": []}, "at least one message", "messages"),
])
def test_what_is_not_supported_is_refused_naming_the_field(body: dict[str, Any], words: str, param: str) -> None:
    e = refused(**body)
    assert words in e.message and e.param == param


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"tool_choice": {"type": "sometimes"}, "messages": []}, "tool_choice.type"),
    ({"system": [{"type": "image", "source": {}}], "messages": []}, "system[0].type"),  # text blocks only
    ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
])
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


@pytest.mark.parametrize("status, kind", [
    (400, "invalid_request_error"), (401, "authentication_error"), (404, "not_found_error"),
    (413, "request_too_large"), (415, "invalid_request_error"), (429, "rate_limit_error"), (500, "api_error"),
    (503, "overloaded_error"), (529, "overloaded_error"), (502, "api_error")])
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
    fmt = MessagesFormatter("msg_x", "tiny", 7)
    start = events(fmt.stream_start())
    assert [k for k, _ in start] == ["message_start", "content_block_start", "ping"]
    assert start[0][1]["message"]["usage"] == {"input_tokens": 7, "output_tokens": 0}
    assert start[1][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert events(fmt.stream_chunk([Output(0, "Hé\n", [1], 1)], None) or b"") == [
        ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "text_delta", "text": "Hé\n"}})]
    assert fmt.stream_chunk([Output(0, "", [], 1)], None) is None  # nothing new: nothing sent
    end = events(fmt.stream_chunk([Output(0, "", [2], 2, "stop", "END")], None) or b"")
    assert end == [("content_block_stop", {"type": "content_block_stop", "index": 0}),
                   ("message_delta", {"type": "message_delta",
                                      "delta": {"stop_reason": "stop_sequence", "stop_sequence": "END"},
                                      "usage": {"input_tokens": 7, "output_tokens": 2}}),
                   ("message_stop", {"type": "message_stop"})]
    assert FRAMING.done == b"" and events(FRAMING.keepalive) == [("ping", {"type": "ping"})]
    assert events(FRAMING.error(APIError("engine died", status=500))) == [
        ("error", {"type": "error", "error": {"type": "api_error", "message": "engine died"}})]


def test_final_message_shape() -> None:
    fmt = MessagesFormatter("msg_x", "tiny", 7)
    body = json.loads(fmt.final([Output(0, "Hello", [1, 2, 3], 3, "length")], Usage(7, 3, 10)))
    assert body == {"type": "message", "id": "msg_x", "role": "assistant", "model": "tiny",
                    "content": [{"type": "text", "text": "Hello"}], "stop_reason": "max_tokens",
                    "stop_sequence": None, "usage": {"input_tokens": 7, "output_tokens": 3}}
