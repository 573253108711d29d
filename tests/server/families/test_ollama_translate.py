"""Ollama's requests onto the OpenAI structs (options, format, messages) and its NDJSON answers (thinking, tool calls
as objects, the final chunk's counts), in-process."""

from __future__ import annotations

import json

import msgspec
import pytest

from server.families.ollama.formatter import OllamaFormatter
from server.families.ollama.keep_alive import unloads
from server.families.ollama.protocol import chat_decoder, generate_decoder
from server.families.ollama.translate import chat_request, generate_chat, generate_text
from server.http.errors import APIError
from server.reasoning.parser import get_reasoning_parser
from server.request.collector import Output
from server.request.input_processor import ModelLimits
from server.structured.parsing import ChoiceParser
from server.tools.parser_names import get_tool_parser

LIMITS = ModelLimits(max_model_len=4096, vocab_size=1000)


def test_options_map_onto_sampling_and_unknown_ones_are_ignored() -> None:
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "options": {
            "temperature": 0.5,
            "top_k": 7,
            "top_p": 0.9,
            "min_p": 0.1,
            "num_predict": 33,
            "stop": ["\n"],
            "seed": 4,
            "num_ctx": 2048,
            "repeat_penalty": 1.2,
            "presence_penalty": 0.3,
            "frequency_penalty": 0.4,
            "mirostat": 2,
            "num_gpu": 99,
        },
    }
    chat = chat_request(chat_decoder.decode(json.dumps(body)), LIMITS, images=False)
    got = {k: getattr(chat, k) for k in ("temperature", "top_k", "top_p", "min_p", "max_tokens", "stop", "seed")}
    assert got == {
        "temperature": 0.5,
        "top_k": 7,
        "top_p": 0.9,
        "min_p": 0.1,
        "max_tokens": 33,
        "stop": ["\n"],
        "seed": 4,
    }
    assert (chat.repetition_penalty, chat.presence_penalty, chat.frequency_penalty) == (1.2, 0.3, 0.4)
    assert chat.stream is True  # Ollama streams unless told not to
    infinite = chat_decoder.decode(json.dumps({**body, "options": {"num_predict": -1}}))
    assert chat_request(infinite, LIMITS, images=False).max_tokens is None


def test_num_ctx_beyond_max_model_len_and_bad_format_are_400() -> None:
    too_long = chat_decoder.decode(b'{"messages": [], "options": {"num_ctx": 8192}}')
    with pytest.raises(APIError, match="max_model_len"):
        chat_request(too_long, LIMITS, images=False)
    with pytest.raises(APIError, match="format"):
        chat_request(chat_decoder.decode(b'{"format": "yaml"}'), LIMITS, images=False)


def test_format_and_messages() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = {
        "format": schema,
        "think": False,
        "messages": [
            {"role": "user", "content": "look", "images": ["iVBORw0KGgo="]},
            {
                "role": "assistant",
                "content": "",
                "thinking": "hmm",
                "tool_calls": [{"function": {"name": "f", "arguments": {"x": 1}}}],
            },
            {"role": "tool", "content": "2", "tool_name": "f"},
        ],
    }
    chat = chat_request(chat_decoder.decode(json.dumps(body)), LIMITS, images=True)
    assert chat.response_format is not None and chat.response_format.json_schema is not None
    assert chat.response_format.json_schema.schema == schema
    assert chat.chat_template_kwargs == {"enable_thinking": False}
    assert chat.messages is not None
    user, assistant, tool = chat.messages
    assert user["content"][0] == {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    assert assistant["tool_calls"][0]["function"] == {"name": "f", "arguments": {"x": 1}}
    assert assistant["reasoning_content"] == "hmm" and tool["name"] == "f"
    with pytest.raises(APIError, match="images"):
        chat_request(chat_decoder.decode(json.dumps(body)), LIMITS, images=False)
    assert chat_request(chat_decoder.decode(b'{"format": "json"}'), LIMITS, images=False).response_format == (
        msgspec.convert({"type": "json_object"}, type(chat.response_format))
    )


def test_generate_templated_raw_and_refusals() -> None:
    templated = generate_chat(generate_decoder.decode(b'{"prompt": "p", "system": "s"}'), LIMITS, images=False)
    assert templated.messages == [{"role": "system", "content": "s"}, {"role": "user", "content": "p"}]
    raw = generate_text(generate_decoder.decode(b'{"prompt": "p", "raw": true}'), LIMITS)
    assert raw.prompt == "p" and raw.suffix is None and raw.add_special_tokens is False
    fim = generate_text(generate_decoder.decode(b'{"prompt": "p", "suffix": "s"}'), LIMITS)
    assert fim.suffix == "s"
    with pytest.raises(APIError):  # a Go template is not served; `context` is (test_ollama_context.py)
        generate_chat(generate_decoder.decode(b'{"prompt": "p", "template": "{{ .Prompt }}"}'), LIMITS, images=False)
    assert unloads(0) and unloads("0s") and unloads("0") and not unloads("5m") and not unloads(None)


def _out(text: str, finish: str | None, n: int) -> Output:
    return Output(0, text, [], n, finish)


def test_thinking_and_tool_calls_streamed_equal_not_streamed() -> None:
    text = '<think>let me see</think>Sure.<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'

    def parser() -> ChoiceParser:
        return ChoiceParser(get_reasoning_parser("qwen3")(), get_tool_parser("hermes")())

    whole = json.loads(OllamaFormatter("m", 5, parser(), chat=True).final([_out(text, "stop", 9)], None))  # type: ignore[arg-type]
    message = whole["message"]
    assert message["thinking"] == "let me see" and message["content"] == "Sure."
    assert message["tool_calls"] == [{"function": {"name": "f", "arguments": {"x": 1}}}]
    assert whole["done"] is True and whole["done_reason"] == "stop" and whole["prompt_eval_count"] == 5
    assert whole["eval_count"] == 9
    streamed = OllamaFormatter("m", 5, parser(), chat=True)
    pieces = [text[i : i + 7] for i in range(0, len(text), 7)]
    lines = [streamed.stream_chunk([_out(p, None, 1)], None) for p in pieces[:-1]]
    lines.append(streamed.stream_chunk([_out(pieces[-1], "stop", 9)], None))
    chunks = [json.loads(line) for line in lines if line is not None]
    assert all(line.endswith(b"\n") and line.count(b"\n") == 1 for line in lines if line is not None)
    assert "".join(c["message"].get("thinking", "") for c in chunks) == "let me see"
    assert "".join(c["message"]["content"] for c in chunks) == "Sure."
    assert chunks[-1]["message"]["tool_calls"] == message["tool_calls"] and chunks[-1]["done"] is True
    generate = json.loads(OllamaFormatter("m", 5, None, chat=False).final([_out("abc", "length", 3)], None))  # type: ignore[arg-type]
    assert generate["response"] == "abc" and generate["done_reason"] == "length"
