"""The benchmarks' judge (bench/judge.py): a pattern Python's `re` cannot read (`\\p{Zs}`, as JSONSchemaBench's
schemas use) is a verdict, not a crash; the schema's own draft decides the rest."""

from __future__ import annotations

import re

import jsonschema
import pytest

from bench.judge import check

SPACE = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[\\p{Zs}A-Za-z]*$"}}}


def test_plain_jsonschema_crashes_on_a_unicode_property_escape() -> None:
    """Why the judge exists: jsonschema reads patterns with `re`, which raises on `\\p{...}`."""
    with pytest.raises(re.error):
        list(jsonschema.Draft202012Validator(SPACE).iter_errors({"name": "a b"}))


@pytest.mark.parametrize(
    "schema, text, verdict",
    [
        (SPACE, '{"name":"a\\u00a0b"}', None),  # U+00A0 is a Zs space
        (SPACE, '{"name":"a_b"}', "pattern"),
        ({"patternProperties": {"^\\p{Lu}": {"type": "integer"}}}, '{"Ab":"x"}', "type"),
        ({"patternProperties": {"^\\p{Lu}": {}}, "additionalProperties": False}, '{"Ab":1}', None),
        ({"patternProperties": {"^\\p{Lu}": {}}, "additionalProperties": False}, '{"ab":1}', "additionalProperties"),
        ({"additionalProperties": {"type": "string"}, "properties": {"a": {}}}, '{"a":1,"b":2}', "type"),
        ({"type": "integer"}, "1.5", "type"),
        ({"type": "integer"}, "{", "not JSON"),
    ],
)
def test_the_judge_reads_ecma_patterns(schema: dict[str, object], text: str, verdict: str | None) -> None:
    result = check(schema, text)
    assert result == verdict if verdict is None else (result or "").startswith(verdict)


def test_the_schema_draft_decides() -> None:
    """Draft 4 ignores what sits beside a $ref; 2020-12 does not."""
    body = {"definitions": {"s": {"type": "string"}}, "properties": {"a": {"$ref": "#/definitions/s", "maxLength": 1}}}
    assert check({"$schema": "http://json-schema.org/draft-04/schema#", **body}, '{"a":"xy"}') is None
    assert check(body, '{"a":"xy"}') is not None
