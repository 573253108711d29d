"""Wire format: decoding (unknown fields ignored, wrong types -> 400 naming the field) and exact OpenAI shapes."""

from __future__ import annotations

import json

import msgspec
import pytest

from server.http.errors import APIError, from_decode_error
from server.request.openai_protocol import (
    ChatChoice,
    ChatCompletionResponse,
    ChatMessage,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    PromptTokensDetails,
    Usage,
    chat_decoder,
    completion_decoder,
    encoder,
)


def decode_error(decoder: msgspec.json.Decoder, body: bytes) -> APIError:  # type: ignore[type-arg]
    with pytest.raises(msgspec.DecodeError) as e:
        decoder.decode(body)
    return from_decode_error(e.value)


def test_unknown_fields_ignored_and_every_issue_field_accepted() -> None:
    body = {
        "model": "m",
        "prompt": [[1, 2], [3]],
        "max_tokens": 5,
        "temperature": 0,
        "top_p": 1,
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "stop": ["a"],
        "seed": 1,
        "logprobs": 2,
        "echo": True,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
        "logit_bias": {"5": -100},
        "user": "u",
        "top_k": 3,
        "min_p": 0.1,
        "repetition_penalty": 1.1,
        "min_tokens": 1,
        "stop_token_ids": [9],
        "include_stop_str_in_output": True,
        "ignore_eos": True,
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
        "add_special_tokens": False,
        "priority": 2,
        "request_id": "r",
        "truncate_prompt_tokens": 4,
        "suffix": "ignored",
        "best_of": 1,
        "something_new": {"x": 1},
    }
    req = completion_decoder.decode(json.dumps(body))
    assert req.prompt == [[1, 2], [3]] and req.stream_options.continuous_usage_stats  # type: ignore[union-attr]
    assert (req.top_k, req.min_tokens, req.request_id, req.truncate_prompt_tokens) == (3, 1, "r", 4)
    chat = chat_decoder.decode(
        json.dumps(
            {
                "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                "max_completion_tokens": 3,
                "logprobs": True,
                "top_logprobs": 2,
                "add_generation_prompt": False,
                "continue_final_message": True,
                "chat_template": "{{ 1 }}",
                "chat_template_kwargs": {"enable_thinking": False},
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "documents": [{"text": "d"}],
                "tool_choice": "auto",
                "response_format": {"type": "text"},
            }
        )
    )
    assert chat.max_completion_tokens == 3 and chat.continue_final_message and chat.tools


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"prompt": "x", "max_tokens": "5"}', "max_tokens"),
        (b'{"prompt": "x", "stream": 1}', "stream"),
        (b'{"prompt": "x", "stop": 5}', "stop"),
        (b'{"prompt": "x", "stream_options": {"include_usage": "yes"}}', "stream_options.include_usage"),
        (b'{"prompt": "x", "logit_bias": {"1": "a"}}', "logit_bias[...]"),
    ],
)
def test_wrong_types_are_400_naming_the_field(body: bytes, param: str) -> None:
    err = decode_error(completion_decoder, body)
    assert err.status == 400 and err.param == param and param in err.message


def test_invalid_json_and_error_shape() -> None:
    err = decode_error(chat_decoder, b'{"messages": [')
    assert err.status == 400 and "not valid JSON" in err.message
    body = json.loads(err.body())
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == 400 and body["error"]["type"] == "BadRequestError"


def test_response_shapes() -> None:
    usage = Usage(3, 2, 5, PromptTokensDetails(1))
    lp = CompletionLogprobs(
        text_offset=[0, 2], token_logprobs=[-0.5, None], tokens=["he", "y"], top_logprobs=[{"he": -0.5}, None]
    )
    resp = json.loads(
        encoder.encode(CompletionResponse("cmpl-1", 7, "m", [CompletionChoice(0, "hey", lp, "stop")], usage))
    )
    assert resp == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 7,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "text": "hey",
                "finish_reason": "stop",
                "stop_reason": None,
                "logprobs": {
                    "text_offset": [0, 2],
                    "token_logprobs": [-0.5, None],
                    "tokens": ["he", "y"],
                    "top_logprobs": [{"he": -0.5}, None],
                },
            }
        ],
        "usage": {
            "prompt_tokens": 3,
            "completion_tokens": 2,
            "total_tokens": 5,
            "prompt_tokens_details": {"cached_tokens": 1},
        },
        "system_fingerprint": None,
    }
    chat = json.loads(
        encoder.encode(
            ChatCompletionResponse(
                "chatcmpl-1", 7, "m", [ChatChoice(0, ChatMessage("assistant", "hi"), None, "length")], usage
            )
        )
    )
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0] == {
        "index": 0,
        "message": {"role": "assistant", "content": "hi", "tool_calls": [], "refusal": None},
        "logprobs": None,
        "finish_reason": "length",
        "stop_reason": None,
    }
