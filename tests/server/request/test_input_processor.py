"""Request validation at, just under and just over each limit; OpenAI-style 400s stating the real numbers."""

from __future__ import annotations

import re
from typing import Any

import msgspec
import pytest

from server.config import RequestCaps, ServerConfig
from server.http.errors import APIError, from_decode_error
from server.request.input_processor import ModelLimits, build_spec, check_prompt_ids, check_request, external_request_id
from server.request.openai_protocol import ChatCompletionRequest, CompletionRequest
from server.request.prompt_shapes import completion_prompts, num_prompts

LIMITS = ModelLimits(
    max_model_len=100, vocab_size=1000, max_logprobs=5, generation_defaults={"temperature": 0.7, "top_k": 20}
)


def completion(**fields: Any) -> CompletionRequest:
    return msgspec.json.decode(msgspec.json.encode({"prompt": "x", **fields}), type=CompletionRequest)


def chat(**fields: Any) -> ChatCompletionRequest:
    return msgspec.json.decode(
        msgspec.json.encode({"messages": [{"role": "user", "content": "x"}], **fields}), type=ChatCompletionRequest
    )


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


@pytest.mark.parametrize(
    ("field", "ok", "bad"),
    [
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
        ("seed", [-(1 << 63), (1 << 63) - 1], []),  # beyond int64: refused at decode (test_int_fields_are_int64)
        ("stop_token_ids", [[0, 999]], [[1000], [-1]]),
        ("logit_bias", [{"999": 100}, {"0": -100}], [{"1000": 1}, {"5": 100.5}, {"x": 1}]),
        ("stop", ["a", ["a", "b"]], [[""]]),
        ("truncate_prompt_tokens", [-1, 1], [0, -2]),
    ],
)
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
    s = spec(
        completion(top_p=0.5, stop="##", ignore_eos=True, seed=3, n=2, priority=-1, logit_bias={"7": 1.5}),
        10,
        index_offset=4,
    )
    assert re.fullmatch(r"[0-9a-f]+-ext", s.request_id)
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


# ---- bounds on the work of one request (issue "Reliability", item 6) ----------------------------------------

CAPS = RequestCaps(
    max_prompts_per_request=3,
    max_choices_per_request=4,
    max_stop_strings=2,
    max_stop_string_length=5,
    max_stop_token_ids=2,
    max_logit_bias=2,
    max_allowed_token_ids=3,
)
CAPPED = ModelLimits(max_model_len=100, vocab_size=1000, caps=CAPS)


def test_defaults_match_server_config() -> None:
    """RequestCaps' defaults are ServerConfig's (the flags' documented defaults), fcfs: no priority."""
    assert ServerConfig().scheduling.request_caps() == RequestCaps() == ModelLimits(max_model_len=2, vocab_size=2).caps
    caps = ServerConfig.from_settings(scheduling_policy="priority", max_stop_strings=7).scheduling.request_caps()
    assert caps.priority_scheduling and caps.max_stop_strings == 7


@pytest.mark.parametrize(
    ("field", "ok", "bad", "flag"),
    [
        # prompt lists: strings and token-id lists count one each; a flat token-id list is one prompt
        (
            "prompt",
            [["a"] * 3, [[1]] * 3, [[1], [2]], list(range(50)), "x"],
            [["a"] * 4, [[1]] * 4],
            "--max-prompts-per-request",
        ),
        ("stop", [["a", "b"], "abcde", ["abcde", "x"]], [["a", "b", "c"], "abcdef", ["a", "abcdef"]], "--max-stop-"),
        ("stop_token_ids", [[1, 2], [1, 1]], [[1, 2, 3], [1] * 3], "--max-stop-token-ids"),
        ("allowed_token_ids", [[1, 2, 3], [5] * 3], [[1, 2, 3, 4], [5] * 4], "--max-allowed-token-ids"),
        ("logit_bias", [{"1": 1, "2": 1}], [{"1": 1, "2": 1, "3": 1}], "--max-logit-bias"),
    ],
)
def test_request_caps_at_under_and_over(field: str, ok: list[Any], bad: list[Any], flag: str) -> None:
    for value in ok:
        check_request(completion(**{field: value}), CAPPED)
    for value in bad:
        err = refused(check_request, completion(**{field: value}), CAPPED)
        assert err.param == field and flag in err.message, err.message
        check_request(completion(**{field: value}), LIMITS)  # the default caps are far above


def test_oversized_lists_are_refused_before_their_ids_are_checked() -> None:
    err = refused(check_request, completion(allowed_token_ids=[10**6] * 4), CAPPED)
    assert "--max-allowed-token-ids" in err.message and "4" in err.message


def test_choices_are_n_times_prompts() -> None:
    check_request(completion(prompt=["a", "b"], n=2), CAPPED)  # 4: at the cap
    check_request(completion(prompt=["a"], n=3), CAPPED)
    check_request(completion(prompt=["a", "b", "c"], n=1), CAPPED)
    for prompt, n in ((["a", "b", "c"], 2), ("a", 5), ([[1], [2]], 3)):
        err = refused(check_request, completion(prompt=prompt, n=n), CAPPED)
        assert err.param == "n" and "--max-choices-per-request" in err.message and "at most 4" in err.message
    check_request(chat(n=4), CAPPED)
    assert refused(check_request, chat(n=5), CAPPED).param == "n"


def test_default_caps_at_and_over() -> None:
    caps = RequestCaps()
    check_request(completion(prompt=["a"] * caps.max_prompts_per_request), LIMITS)
    assert (
        refused(check_request, completion(prompt=["a"] * (caps.max_prompts_per_request + 1)), LIMITS).param == "prompt"
    )
    check_request(completion(prompt=["a"] * 32, n=128), LIMITS)  # 4096 choices
    assert refused(check_request, completion(prompt=["a"] * 33, n=128), LIMITS).param == "n"
    check_request(completion(stop=["s"] * 64), LIMITS)
    assert refused(check_request, completion(stop=["s"] * 65), LIMITS).param == "stop"
    check_request(completion(stop="s" * 1024), LIMITS)
    assert refused(check_request, completion(stop="s" * 1025), LIMITS).param == "stop"
    check_request(completion(stop_token_ids=[1] * 1024, logit_bias={str(i): 1 for i in range(1000)}), LIMITS)
    assert refused(check_request, completion(stop_token_ids=[1] * 1025), LIMITS).param == "stop_token_ids"
    check_request(completion(allowed_token_ids=[1] * caps.max_allowed_token_ids), LIMITS)
    assert (
        refused(check_request, completion(allowed_token_ids=[1] * (caps.max_allowed_token_ids + 1)), LIMITS).param
        == "allowed_token_ids"
    )
    big = ModelLimits(max_model_len=100, vocab_size=5000)
    check_request(completion(logit_bias={str(i): 1 for i in range(1024)}), big)
    assert refused(check_request, completion(logit_bias={str(i): 1 for i in range(1025)}), big).param == "logit_bias"


def test_num_prompts() -> None:
    assert [num_prompts(p) for p in ("a", None, [], [1, 2], ["a", "b"], [[1], [2], [3]])] == [1, 1, 1, 1, 2, 3]


# ---- priority needs --scheduling-policy priority (as vLLM) ------------------------------------------------


def test_priority_is_refused_under_fcfs() -> None:
    check_request(completion(priority=0), LIMITS)
    for value in (1, -1, (1 << 63) - 1, -(1 << 63)):
        err = refused(check_request, completion(priority=value), LIMITS)
        assert err.param == "priority" and "--scheduling-policy priority" in err.message
        refused(check_request, chat(priority=value), LIMITS)
    prio = ModelLimits(max_model_len=100, vocab_size=1000, caps=RequestCaps(priority_scheduling=True))
    for value in (0, 1, -1, (1 << 63) - 1, -(1 << 63)):
        check_request(completion(priority=value), prio)
        check_request(chat(priority=value), prio)


# ---- every request integer fits int64 (issue "Reliability", item 7) ---------------------------------------

BEYOND_INT64 = (1 << 63, 1 << 64, -(1 << 63) - 1)


def _int_paths(struct: Any, prefix: str = "") -> list[tuple[str, bool, Any]]:
    """(dotted field path, is a list of ints, its IntType) for every integer a request struct decodes."""
    out: list[tuple[str, bool, Any]] = []
    for f in msgspec.inspect.type_info(struct).fields:  # type: ignore[attr-defined]
        kinds = f.type.types if isinstance(f.type, msgspec.inspect.UnionType) else (f.type,)
        for t in kinds:
            if isinstance(t, msgspec.inspect.IntType):
                out.append((prefix + f.name, False, t))
            elif isinstance(t, msgspec.inspect.ListType) and isinstance(t.item_type, msgspec.inspect.IntType):
                out.append((prefix + f.name, True, t.item_type))
            elif isinstance(t, msgspec.inspect.StructType):
                out += _int_paths(t.cls, prefix + f.name + ".")
    return out


def _request_types() -> list[Any]:
    from server.families.vllm.generate import GenerateRequest

    return [CompletionRequest, ChatCompletionRequest, GenerateRequest]


def _body(path: str, value: Any) -> dict[str, Any]:
    body: dict[str, Any] = {}
    head, _, rest = path.partition(".")
    body[head] = _body(rest, value) if rest else value
    return body


def test_every_request_int_is_bounded_to_int64() -> None:
    """A new int field without Int64 fails here: its 2**64 would decode, then fail to pack (a 500)."""
    for struct in _request_types():
        for path, _, t in _int_paths(struct):
            assert (t.ge, t.le) == (-(1 << 63), (1 << 63) - 1), f"{struct.__name__}.{path}"


@pytest.mark.parametrize("struct", ["CompletionRequest", "ChatCompletionRequest", "GenerateRequest"])
def test_int_fields_beyond_int64_are_a_400_naming_the_field(struct: str) -> None:
    cls = next(t for t in _request_types() if t.__name__ == struct)
    decoder = msgspec.json.Decoder(cls)
    base: dict[str, Any] = {"token_ids": [1]} if struct == "GenerateRequest" else {}
    paths = _int_paths(cls)
    expected = {
        "max_tokens",
        "n",
        "seed",
        "top_k",
        "min_tokens",
        "stop_token_ids",
        "allowed_token_ids",
        "priority",
        *{
            "CompletionRequest": ["logprobs", "truncate_prompt_tokens"],
            "ChatCompletionRequest": ["top_logprobs", "max_completion_tokens", "truncate_prompt_tokens"],
            "GenerateRequest": ["logprobs", "token_ids"],
        }[struct],
    }
    names = {p.rsplit(".", 1)[-1] for p, _, _ in paths}
    assert expected <= names, names
    for path, is_list, _ in paths:
        for value in BEYOND_INT64:
            body = {**base, **_body(path, [1, value] if is_list else value)}
            with pytest.raises(msgspec.ValidationError) as e:
                decoder.decode(msgspec.json.encode(body))
            err = from_decode_error(e.value)
            assert err.status == 400 and err.param == (f"{path}[1]" if is_list else path), (path, err.message)
            assert path.rsplit(".", 1)[-1] in err.message
        for value in ((1 << 63) - 1, -(1 << 63)):  # at the bounds: decodes
            decoder.decode(msgspec.json.encode({**base, **_body(path, [value] if is_list else value)}))
