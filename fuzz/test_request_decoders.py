"""Request bodies: arbitrary JSON values and bytes reach the request decoders; only msgspec's
DecodeError (ValidationError is one) may escape, which the routes turn into a 400. Bodies that are
not a JSON object are refused; valid requests decode to the values sent; what decodes re-encodes
to an equal request."""

from __future__ import annotations

import json
import os
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server.request.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_decoder,
    completion_decoder,
    decode_request,
)

EXAMPLES = int(os.environ.get("SPINDLE_FUZZ_EXAMPLES", "100"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize="SPINDLE_FUZZ_EXAMPLES" not in os.environ,
    suppress_health_check=[HealthCheck.too_slow],
)
DECODERS = [completion_decoder, chat_decoder]

scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=25,
)
FIELDS = sorted(set(CompletionRequest.__struct_fields__) | set(ChatCompletionRequest.__struct_fields__))
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", 3]), "content": json_values}
)
field_values = st.one_of(json_values, st.lists(message, max_size=3), st.lists(st.integers(), max_size=4))
request_like = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6), field_values, max_size=10)

# Requests every decoder must take: the fields each route defines, with values of their types.
INT64 = st.integers(-(2**63), 2**63 - 1)
shared_fields = {
    "max_tokens": st.integers(1, 4096),
    "temperature": st.floats(0, 2),
    "n": st.integers(1, 8),
    "stop": st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=3),
    "seed": INT64,
    "stream": st.booleans(),
    "stop_token_ids": st.lists(INT64, max_size=3),
    "priority": INT64,
}
completion_bodies = st.fixed_dictionaries(
    {
        "prompt": st.text(max_size=30)
        | st.lists(st.integers(0, 150_000), min_size=1, max_size=8)
        | st.lists(st.text(max_size=10), min_size=1, max_size=3)
    },
    optional={**shared_fields, "logprobs": st.integers(0, 20), "echo": st.booleans()},
)
chat_bodies = st.fixed_dictionaries(
    {
        "messages": st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["user", "system", "assistant"]), "content": st.text(max_size=30)}
            ),
            min_size=1,
            max_size=3,
        )
    },
    optional={
        **shared_fields,
        "max_completion_tokens": INT64,
        "logprobs": st.booleans(),
        "top_logprobs": st.integers(0, 20),
        "tool_choice": st.sampled_from(["none", "auto", "required"]),
    },
)


def decode_all(body: bytes) -> list[msgspec.Struct]:
    """What each decoder makes of `body` (those that refuse it are left out); each decoded request re-encodes to
    one that decodes equal."""
    decoded = []
    for decoder in DECODERS:
        try:
            req = decode_request(decoder, body)
        except msgspec.DecodeError:
            continue
        assert decode_request(decoder, msgspec.json.encode(req)) == req
        decoded.append(req)
    return decoded


@FUZZ
@given(st.one_of(json_values, request_like))
def test_json_values_decode_or_fail_cleanly(value: object) -> None:
    decoded = decode_all(json.dumps(value).encode())
    if not isinstance(value, dict):  # a request is a JSON object
        assert decoded == []


@FUZZ
@given(completion_bodies, chat_bodies)
def test_valid_requests_decode_to_what_was_sent(completion: dict[str, Any], chat: dict[str, Any]) -> None:
    for decoder, body in ((completion_decoder, completion), (chat_decoder, chat)):
        req = decode_request(decoder, json.dumps(body).encode())
        assert {k: getattr(req, k) for k in body} == body


@FUZZ
@given(st.binary(max_size=200))
def test_bytes_fail_cleanly(body: bytes) -> None:
    decoded = decode_all(body)
    if not body.strip().startswith(b"{"):
        assert decoded == []


@FUZZ
@given(
    request_like.map(lambda v: json.dumps(v).encode()).flatmap(
        lambda b: st.tuples(st.just(b), st.integers(0, len(b) - 1))
    )
)
def test_truncated_bodies_are_refused(body_and_cut: tuple[bytes, int]) -> None:
    body, cut = body_and_cut
    assert decode_all(body[:cut]) == []  # a strict prefix of an object is not JSON
    decode_all(body)


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize("field", ["prompt", "messages"])
# regression: msgspec raises RecursionError (not DecodeError) on deep nesting in Any-typed fields
def test_deeply_nested_json_fails_cleanly(field: str) -> None:
    def body(depth: int) -> bytes:
        if field == "prompt":
            return b'{"prompt": ' + nested(depth) + b"}"
        return b'{"messages": [{"content": ' + nested(depth) + b"}]}"

    for decoder in DECODERS:
        with pytest.raises(msgspec.DecodeError, match="nested too deeply"):
            decode_request(decoder, body(10_000))
    # 100 deep is fine: the refusal above is for the depth, not for nesting as such
    req = decode_request(completion_decoder if field == "prompt" else chat_decoder, body(100))
    value: Any = req.prompt if isinstance(req, CompletionRequest) else req.messages[0]["content"]
    assert json.dumps(value, separators=(",", ":")).encode() == nested(100)
