"""response_format / structured_outputs / guided_* on the wire: accepted shapes, wrong types -> 400 naming the field."""

from __future__ import annotations

import json

import msgspec
import pytest

from server.families.vllm.generate import GenerateRequest, as_completion_request
from server.http.errors import APIError, from_decode_error
from server.request.openai_protocol import chat_decoder, completion_decoder

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def decode_error(decoder: msgspec.json.Decoder, body: dict) -> APIError:  # type: ignore[type-arg]
    with pytest.raises(msgspec.DecodeError) as e:
        decoder.decode(json.dumps(body))
    return from_decode_error(e.value)


def test_openai_and_vllm_shapes_decode_on_both_routes() -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "n", "description": "d", "schema": SCHEMA, "strict": True}}
    so = {
        "json": SCHEMA,
        "disable_any_whitespace": True,
        "disable_fallback": False,
        "disable_additional_properties": False,
    }
    for decoder, base in ((chat_decoder, {"messages": []}), (completion_decoder, {"prompt": "x"})):
        req = decoder.decode(
            json.dumps(
                {
                    **base,
                    "response_format": rf,
                    "structured_outputs": so,
                    "guided_regex": "a",
                    "guided_choice": ["x"],
                    "guided_json": "{}",
                    "guided_grammar": "start: 'a'",
                    "guided_decoding_backend": "xgrammar",
                }
            )
        )
        assert req.response_format is not None and req.response_format.json_schema is not None
        assert req.response_format.json_schema.schema == SCHEMA and req.response_format.json_schema.strict
        assert req.structured_outputs is not None and req.structured_outputs.json == SCHEMA
        assert (req.guided_regex, req.guided_choice, req.guided_json) == ("a", ["x"], "{}")
    req = completion_decoder.decode(b'{"structured_outputs": {"json": "{\\"type\\": \\"string\\"}"}}')
    assert req.structured_outputs is not None and req.structured_outputs.json == '{"type": "string"}'


def test_generate_takes_structured_outputs_in_sampling_params() -> None:
    raw = msgspec.json.decode(
        json.dumps({"token_ids": [1], "sampling_params": {"structured_outputs": {"regex": "a+"}}}), type=GenerateRequest
    )
    req = as_completion_request(raw)
    assert req.structured_outputs is not None and req.structured_outputs.regex == "a+"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "structural_tag"}}, "response_format.type"),
        ({"response_format": "json_object"}, "response_format"),
        ({"response_format": {}}, "response_format"),  # type is required
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
            "response_format.json_schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": [1]}}},
            "response_format.json_schema.schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": SCHEMA, "strict": "yes"},
                }
            },
            "response_format.json_schema.strict",
        ),
        ({"structured_outputs": {"json": 5}}, "structured_outputs.json"),
        ({"structured_outputs": {"regex": ["a"]}}, "structured_outputs.regex"),
        ({"structured_outputs": {"choice": "a"}}, "structured_outputs.choice"),
        ({"structured_outputs": {"choice": ["a", 1]}}, "structured_outputs.choice[1]"),
        ({"structured_outputs": {"grammar": {"rules": []}}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"json_object": "true"}}, "structured_outputs.json_object"),
        ({"structured_outputs": "regex"}, "structured_outputs"),
        ({"guided_choice": [None]}, "guided_choice[0]"),
        ({"guided_regex": 7}, "guided_regex"),
    ],
)
def test_wrong_types_are_400_naming_the_field(body: dict, param: str) -> None:  # type: ignore[type-arg]
    for decoder, base in ((chat_decoder, {"messages": []}), (completion_decoder, {"prompt": "x"})):
        err = decode_error(decoder, {**base, **body})
        assert err.status == 400 and err.param == param and param in err.message
        shape = json.loads(err.body())["error"]
        assert set(shape) == {"message", "type", "param", "code"} and shape["type"] == "BadRequestError"
