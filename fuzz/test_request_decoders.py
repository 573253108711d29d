"""Request bodies: arbitrary JSON values and bytes reach the request decoders; only msgspec's
DecodeError (ValidationError is one) may escape, which the routes turn into a 400."""

from __future__ import annotations

import json
import os

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server.protocol.openai import (ChatCompletionRequest, CompletionRequest, chat_decoder, completion_decoder,
                             decode_request)

EXAMPLES = int(os.environ.get("SPINDLE_FUZZ_EXAMPLES", "100"))
FUZZ = settings(
    max_examples=EXAMPLES, deadline=None, derandomize="SPINDLE_FUZZ_EXAMPLES" not in os.environ,
    suppress_health_check=[HealthCheck.too_slow],
)
DECODERS = [completion_decoder, chat_decoder]

scalars = (
    st.none() | st.booleans() | st.integers() | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20)
)
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5), max_leaves=25
)
FIELDS = sorted(set(CompletionRequest.__struct_fields__) | set(ChatCompletionRequest.__struct_fields__))
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", 3]), "content": json_values})
field_values = st.one_of(json_values, st.lists(message, max_size=3), st.lists(st.integers(), max_size=4))
request_like = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6), field_values, max_size=10)


def decode_all(body: bytes) -> None:
    for decoder in DECODERS:
        try:
            req = decode_request(decoder, body)
        except msgspec.DecodeError:
            continue
        msgspec.json.encode(req)  # a decoded request is a well-formed Struct


@FUZZ
@given(st.one_of(json_values, request_like))
def test_json_values_decode_or_fail_cleanly(value: object) -> None:
    decode_all(json.dumps(value).encode())


@FUZZ
@given(st.binary(max_size=200) | request_like.map(lambda v: json.dumps(v).encode()).flatmap(
    lambda b: st.integers(0, len(b)).map(lambda k: b[:k])))
def test_bytes_and_truncated_bodies_fail_cleanly(body: bytes) -> None:
    decode_all(body)


@pytest.mark.parametrize("field", ["prompt", "messages"])
# regression: msgspec raises RecursionError (not DecodeError) on deep nesting in Any-typed fields
def test_deeply_nested_json_fails_cleanly(field: str) -> None:
    depth = 10_000
    nested = b"[" * depth + b"]" * depth
    body = b'{"prompt": ' + nested + b"}" if field == "prompt" else b'{"messages": [{"content": ' + nested + b"}]}"
    decode_all(body)
