"""oneOf enforced as an anyOf that means the same or less (engine/structured/one_of.py, through strict_schema's
rewrites): what the grammar takes is checked against jsonschema on the original schema, so no answer it allows can
meet two branches."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from engine.structured.one_of import first_one_of, patterns_disjoint
from engine.structured.relaxed_schema import relax
from tests.engine.structured.test_relaxed_schema import STYLE, accepts

STEP = {
    "definitions": {
        "paragraph": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
        "list": {
            "type": "object",
            "properties": {"items": {"type": "array", "items": {"type": "string"}}, "text": {"type": "string"}},
            "required": ["items"],
        },
    },
    "type": "array",
    "items": {"oneOf": [{"$ref": "#/definitions/paragraph"}, {"$ref": "#/definitions/list"}]},
}
NULLABLE = {
    "definitions": {"at": {"type": "string", "maxLength": 8}},
    "type": "object",
    "properties": {"at": {"oneOf": [{"$ref": "#/definitions/at"}, {"type": "null"}]}},
    "required": ["at"],
}
EITHER = {
    "type": "object",
    "additionalProperties": False,
    "properties": {"key": {"type": "string"}, "env": {"type": "string"}, "value": {"type": "string"}},
    "required": ["key"],
    "oneOf": [
        {"required": ["env"], "not": {"required": ["value"]}},
        {"required": ["value"], "not": {"required": ["env"]}},
    ],
}
HOST = {"type": "string", "maxLength": 12, "oneOf": [{"pattern": "^[^:]+$"}, {"pattern": "^[^:]+:[^:]+:[0-9]+$"}]}
HOSTS = {"type": "string", "oneOf": [{"format": "hostname"}, {"format": "ipv4"}, {"format": "ipv6"}]}
NAMES = {  # no type: a string meets both `required`s
    "oneOf": [
        {"properties": {"first": {"type": "string"}}, "required": ["first"]},
        {"properties": {"last": {"type": "string"}}, "required": ["last"]},
    ]
}
COUNTRY = {
    "type": "object",
    "oneOf": [
        {"properties": {"country": {"enum": ["CAN"]}, "state": {"enum": ["AB", "BC"]}}},
        {"properties": {"country": {"enum": ["MEX"]}, "state": {"type": "string"}}},
    ],
}
OTHER_COUNTRY = {
    "type": "object",
    "required": ["country"],
    "oneOf": [
        {"properties": {"country": {"type": "string", "enum": ["CAN"]}}},
        {"properties": {"country": {"not": {"type": "string", "enum": ["CAN", "MEX"]}}}},
    ],
}
IMAGES = {
    "definitions": {"name": {"enum": ["a", "b"]}},
    "oneOf": [{"type": "array", "items": {"$ref": "#/definitions/name"}}, {"$ref": "#/definitions/name"}],
}
VERSIONS = {
    "type": "object",
    "required": ["version"],
    "oneOf": [{"properties": {"version": {"const": "2"}}}, {"properties": {"version": {"const": "1"}}}],
}
CLOSED = {
    "oneOf": [
        {"type": "object", "properties": {"x": {"type": "integer"}}, "additionalProperties": False},
        {"type": "object", "properties": {"y": {"type": "integer"}}, "additionalProperties": False},
    ]
}


def _valid(schema: Any, text: str) -> bool:
    validator = jsonschema.Draft7Validator(schema, format_checker=jsonschema.Draft7Validator.FORMAT_CHECKER)
    return validator.is_valid(json.loads(text))


@pytest.mark.parametrize(
    "schema, texts",
    [
        (
            STEP,
            [
                '[{"text":"a"}]',
                '[{"items":["a"]}]',
                '[{"text":"a","items":["b"]}]',  # both branches: oneOf fails
                '[{"items":["a"],"text":"b"}]',
            ],
        ),
        (NULLABLE, ['{"at":"x"}', '{"at":null}', '{"at":1}']),
        (
            EITHER,
            ['{"key":"k","env":"E"}', '{"key":"k","value":"v"}', '{"key":"k","env":"E","value":"v"}', '{"key":"k"}'],
        ),
        (HOST, ['"a"', '"a:b:1"', '"a:b"', '""']),
        (CLOSED, ['{"x":1}', '{"y":1}', "{}", '{"x":1,"y":2}']),
        (HOSTS, ['"example.com"', '"1.2.3.4"', '"::1"']),  # an IPv4 address may pass as a hostname: left out
        (NAMES, ['{"first":"a"}', '{"last":"b"}', '{"first":"a","last":"b"}', '"x"']),  # "x": both branches
        (COUNTRY, ['{"country":"CAN","state":"AB"}', '{"country":"MEX"}', "{}", '{"state":"AB"}']),
        ({"type": "integer", "oneOf": [{"minimum": -1, "maximum": -1}, {"minimum": 50, "maximum": 100}]}, ["-1", "50"]),
        (IMAGES, ['"a"', '["a","b"]', "[]"]),
        (VERSIONS, ['{"version":"2"}', '{"version":"1"}', "{}"]),
        ({"type": "string", "oneOf": [{"enum": ["window"]}, {"enume": ["inline"]}]}, ['"window"', '"inline"']),
        (OTHER_COUNTRY, ['{"country":"CAN"}', '{"country":"FRA"}', "{}"]),
        ({"type": "string", "oneOf": [{"maxLength": 0}, {"minLength": 1, "maxLength": 3}]}, ['""', '"ab"']),
    ],
    ids=[
        "refs-required",
        "ref-or-null",
        "not-required",
        "patterns",
        "closed-objects",
        "formats",
        "untyped-objects",
        "optional-discriminator",
        "ranges",
        "values-and-types",
        "node-requires-it",
        "a-branch-that-takes-anything",
        "not-enum",
        "lengths",
    ],
)
def test_a_one_of_whose_branches_can_be_told_apart_is_enforced(schema: dict[str, Any], texts: list[str]) -> None:
    out = relax(schema, STYLE)
    assert out.keywords == (), out.keywords
    taken = [t for t in texts if accepts(out.schema, t)]
    assert taken, "the grammar takes none of the answers"
    for text in taken:
        assert _valid(schema, text), text  # never an answer that meets two branches (or none)


def test_an_overlap_the_grammar_cannot_rule_out_stays_relaxed() -> None:
    assert relax({"oneOf": [{"type": "number"}, {"type": "integer"}]}, STYLE).keywords == ("oneOf",)
    formats = {"type": "string", "oneOf": [{"format": "hostname"}, {"format": "uri"}]}
    assert "oneOf" in relax(formats, STYLE).keywords


def test_only_a_one_of_whose_branches_may_overlap_is_named() -> None:
    assert first_one_of({"properties": {"a": {"oneOf": [{"type": "string"}]}}}) is None  # one branch
    assert first_one_of({"oneOf": [{"type": "string"}, {"type": "null"}]}) is None
    assert first_one_of({"items": {"oneOf": [{"type": "number"}, {"type": "integer"}]}}) == "/items"


def test_patterns_disjoint() -> None:
    assert patterns_disjoint("^[a-z]+$", "^[0-9]+$")
    assert not patterns_disjoint("a", "b")  # unanchored: "ab" matches both
    assert not patterns_disjoint("^[a-z]+$", "^[a-c]+$")
    assert not patterns_disjoint("^(?!x)", "^y")  # a regex llguidance cannot read proves nothing
