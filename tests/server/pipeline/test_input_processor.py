"""Request validation at, just under and just over each limit; OpenAI-style 400s stating the real numbers."""

from __future__ import annotations

import re
from typing import Any

import msgspec
import pytest

from server.http.errors import APIError
from server.pipeline.input_processor import (
    ModelLimits, build_spec, check_prompt_ids, check_request, completion_prompts, external_request_id,
)
from server.protocol.openai import ChatCompletionRequest, CompletionRequest

LIMITS = ModelLimits(max_model_len=100, vocab_size=1000, max_logprobs=5,
                     generation_defaults={"temperature": 0.7, "top_k": 20})


def completion(**fields: Any) -> CompletionRequest:
    return msgspec.json.decode(msgspec.json.encode({"prompt": "x", **fields}), type=CompletionRequest)


def chat(**fields: Any) -> ChatCompletionRequest:
    return msgspec.json.decode(msgspec.json.encode({"messages": [{"role": "user", "content": "x"}], **fields}),
                               type=ChatCompletionRequest)


def refused(fn: Any, *args: Any, **kw: Any) -> APIError:
    with pytest.raises(APIError) as e:
        fn(*args, **kw)
    assert e.value.status == 400
    return e.value


def spec(req: Any, n_prompt: int, **kw: Any) -> Any:
    return build_spec(req, list(range(n_prompt)), LIMITS, external_id="ext", stream=False, **kw)


def test_prompt_length_at_and_around_max_model_len() -> None:
    assert spec(completion(), 99).params.max_tokens == 1  # one token of room: max_tokens null fills it
    err = refused(spec, completion(), 100)  # exactly max_model_len prompt tokens leaves no room
    assert "100 tokens" in err.message and "100 input tokens" in err.message
    refused(spec, completion(), 101)


def test_prompt_plus_max_tokens() -> None:
    assert spec(completion(max_tokens=60), 40).params.max_tokens == 60  # at the limit
    assert spec(completion(max_tokens=59), 40).params.max_tokens == 59
    err = refused(spec, completion(max_tokens=61), 40)
    assert "101 tokens (40 in the input, 61 in the completion)" in err.message and err.param == "max_tokens"
    # chat: max_completion_tokens wins over max_tokens
    assert spec(chat(max_tokens=5, max_completion_tokens=60), 40).params.max_tokens == 60
    refused(spec, chat(max_tokens=5, max_completion_tokens=61), 40)


@pytest.mark.parametrize(("field", "ok", "bad"), [
    ("temperature", [0, 2.0], [-0.01, 2.01]),
    ("top_p", [1e-9, 1.0], [0.0, 1.01]),
    ("min_p", [0.0, 1.0], [-0.1, 1.1]),
    ("presence_penalty", [-2.0, 2.0], [-2.1, 2.1]),
    ("frequency_penalty", [-2.0, 2.0], [-2.1, 2.1]),
    ("repetition_penalty", [0.01, 2.0], [0.0, 2.1]),
    ("top_k", [-1, 0, 50], [-2]),
    ("n", [1, 128], [0, 129]),
    ("max_tokens", [1], [0, -1]),
    ("logprobs", [0, 5], [-1, 6]),
    ("seed", [-(1 << 63), (1 << 63) - 1], [1 << 63]),
    ("stop_token_ids", [[0, 999]], [[1000], [-1]]),
    ("logit_bias", [{"999": 100}, {"0": -100}], [{"1000": 1}, {"5": 100.5}, {"x": 1}]),
    ("stop", ["a", ["a", "b"]], [[""]]),
    ("truncate_prompt_tokens", [-1, 1], [0, -2]),
])
def test_sampling_fields(field: str, ok: list[Any], bad: list[Any]) -> None:
    for value in ok:
        check_request(completion(**{field: value}), LIMITS)
    for value in bad:
        err = refused(check_request, completion(**{field: value}), LIMITS)
        assert err.param == field, err.message


def test_messages_state_the_numbers() -> None:
    assert "got 2.5" in refused(check_request, completion(temperature=2.5), LIMITS).message
    assert "between 0 and 5" in refused(check_request, completion(logprobs=6), LIMITS).message
    assert "[0, 1000)" in refused(check_request, completion(stop_token_ids=[1000]), LIMITS).message
    err = refused(check_request, completion(min_tokens=11, max_tokens=10), LIMITS)
    assert "(11)" in err.message and "(10)" in err.message


def test_chat_logprobs() -> None:
    check_request(chat(logprobs=True, top_logprobs=5), LIMITS)
    assert refused(check_request, chat(logprobs=True, top_logprobs=6), LIMITS).param == "top_logprobs"
    assert refused(check_request, chat(top_logprobs=2), LIMITS).param == "top_logprobs"  # needs logprobs
    assert spec(chat(logprobs=True), 3).params.logprobs == 0
    assert spec(chat(), 3).params.logprobs is None


def test_token_ids_in_vocab() -> None:
    check_prompt_ids([0, 999], 1000)
    assert "1000" in refused(check_prompt_ids, [0, 1000], 1000).message
    refused(check_prompt_ids, [-1], 1000)


def test_prompt_shapes() -> None:
    assert completion_prompts("a") == ["a"]
    assert completion_prompts(["a", "b"]) == ["a", "b"]
    assert completion_prompts([1, 2]) == [[1, 2]]
    assert completion_prompts([[1], [2, 3]]) == [[1], [2, 3]]
    for bad in (None, [], ["a", 1], [[1], []], [[1], "a"], [1.5], [True]):
        refused(completion_prompts, bad)


def test_params_request_id_and_defaults() -> None:
    s = spec(completion(top_p=0.5, stop="##", ignore_eos=True, seed=3, n=2, priority=-1,
                        logit_bias={"7": 1.5}), 10, index_offset=4)
    assert re.fullmatch(r"ext-[A-Za-z0-9]{8}", s.request_id)
    assert s.child_ids() == [f"{s.request_id}-0", f"{s.request_id}-1"]
    assert [s.child_params(i).seed for i in range(2)] == [3, 4]
    p = s.params
    assert (p.temperature, p.top_k, p.top_p) == (0.7, 20, 0.5)  # generation_config defaults fill unset fields
    assert p.max_tokens == 90 and p.ignore_eos and p.logit_bias == {7: 1.5}
    assert s.stop == ("##",) and s.priority == -1 and s.index_offset == 4
    assert spec(completion(truncate_prompt_tokens=3), 10).prompt_token_ids == [7, 8, 9]
    assert external_request_id("hdr", "body") == "hdr" and external_request_id(None, "body") == "body"
    assert re.fullmatch(r"[0-9a-f]{32}", external_request_id(None, None))


def test_stream_options_need_stream() -> None:
    refused(check_request, completion(stream_options={"include_usage": True}), LIMITS)
    check_request(completion(stream=True, stream_options={"include_usage": True}), LIMITS)
