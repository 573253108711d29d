"""`unevaluatedProperties` as `additionalProperties` (engine/structured/unevaluated.py, run by strict_schema.rewrite):
the rewrite accepts exactly the documents the original does (jsonschema, 2020-12, on many objects), llguidance
enforces it, and where the evaluated keys depend on the value it stays as it was (relaxed)."""

from __future__ import annotations

import copy
import itertools
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from engine.structured import unevaluated
from engine.structured.relaxed_schema import relax
from engine.structured.strict_schema import _nodes, rewrite
from engine.structured.unevaluated import rewrite_unevaluated
from tests.engine.structured.test_relaxed_schema import STYLE, accepts

CORPUS = Path(__file__).resolve().parents[3] / "bench" / "schemas"
DIALECT = "https://json-schema.org/draft/2020-12/schema"
EXT = {"patternProperties": {"^x-": True}}
VALUES: list[Any] = ["s", 1, None]
KEYS = ["foo", "bar", "baz", "x-a", "kind", ""]


def objects() -> list[dict[str, Any]]:
    """Every object of up to three of KEYS, each key with each of VALUES (and "kind" with "a" / "b")."""
    found: list[dict[str, Any]] = []
    for n in range(4):
        for keys in itertools.combinations(KEYS, n):
            options = [["a", "b", 1] if k == "kind" else VALUES for k in keys]
            found += [dict(zip(keys, vals)) for vals in itertools.product(*options)]
    return found


def same_documents(a: dict[str, Any], b: dict[str, Any]) -> None:
    va, vb = jsonschema.Draft202012Validator(a), jsonschema.Draft202012Validator(b)
    differ = [o for o in objects() if va.is_valid(o) != vb.is_valid(o)]
    assert not differ, differ[:5]


def only_this(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema after this rewrite alone (the others leave fewer documents valid, not the same)."""
    work = copy.deepcopy(schema)
    rewrite_unevaluated(work, _nodes(work), _nodes)
    return work


def closed(schema: dict[str, Any]) -> bool:
    """No unevaluatedProperties left anywhere in the rewrite."""
    return "unevaluatedProperties" not in json.dumps(rewrite(schema))


REWRITTEN = [
    pytest.param({"properties": {"foo": {"type": "string"}}, "unevaluatedProperties": False}, id="own"),
    pytest.param({"unevaluatedProperties": {"type": "string"}}, id="schema-valued"),
    pytest.param(
        {"properties": {"foo": True}, "$ref": "#/$defs/ext", "$defs": {"ext": EXT}, "unevaluatedProperties": False},
        id="ref",
    ),
    pytest.param(
        {
            "allOf": [{"properties": {"foo": {"type": "string"}}}, {"$ref": "#/$defs/ext"}],
            "$defs": {"ext": EXT},
            "unevaluatedProperties": {"type": "integer"},
        },
        id="allOf",
    ),
    pytest.param(
        {
            "properties": {"foo": True, "bar": True},
            "anyOf": [{"required": ["foo"]}, {"properties": {"bar": {"type": "null"}}}],
            "unevaluatedProperties": False,
        },
        id="conditional-names-covered",
    ),
    pytest.param(
        {
            "properties": {"kind": True},
            "patternProperties": {"^x-": True},
            "if": {"properties": {"kind": {"const": "a"}}},
            "then": {"properties": {"x-a": {"type": "string"}}},
            "unevaluatedProperties": False,
        },
        id="conditional-name-matched-by-pattern",
    ),
    pytest.param(
        {
            "$defs": {"group": {"a": {"properties": {"foo": True}, "unevaluatedProperties": False}}},
            "$ref": "#/$defs/group/a",
        },
        id="in-a-folder-of-definitions",  # meltano's "#/$defs/plugins/..."
    ),
    pytest.param({"additionalProperties": {"type": "string"}, "unevaluatedProperties": False}, id="additional-beside"),
    pytest.param(
        {
            "allOf": [{"properties": {"foo": {"type": "string"}}, "unevaluatedProperties": True}],
            "unevaluatedProperties": False,
        },
        id="nested-open",
    ),
    pytest.param(
        {
            "$schema": DIALECT,
            "allOf": [{"properties": {"foo": True}}],
            "anyOf": [{"properties": {"bar": True}, "unevaluatedProperties": False}],
        },
        id="cousins",
    ),
]


@pytest.mark.parametrize("schema", REWRITTEN)
def test_the_rewrite_accepts_the_same_documents(schema: dict[str, Any]) -> None:
    assert closed(schema)
    same_documents(schema, only_this(schema))


NOT_REWRITTEN = [
    pytest.param(
        {
            "properties": {"foo": True},
            "anyOf": [
                {"properties": {"bar": {"const": 1}}, "required": ["bar"]},
                {"properties": {"baz": {"const": 1}}, "required": ["baz"]},
            ],
            "unevaluatedProperties": False,
        },
        id="anyOf-names-its-own-keys",
    ),
    pytest.param(
        {
            "properties": {"foo": True},
            "dependentSchemas": {"foo": {"properties": {"bar": True}}},
            "unevaluatedProperties": False,
        },
        id="dependentSchemas-names-its-own-key",
    ),
    pytest.param(
        {
            "properties": {"kind": True},
            "if": {"properties": {"kind": {"const": "a"}}},
            "then": {"properties": {"bar": True}},
            "else": {"properties": {"baz": True}},
            "unevaluatedProperties": False,
        },
        id="if-then-else-name-their-own-keys",
    ),
    pytest.param(
        {
            "patternProperties": {"^x-": True},
            "oneOf": [{"patternProperties": {"^b": True}}],
            "unevaluatedProperties": False,
        },
        id="conditional-pattern",
    ),
    pytest.param(
        {"properties": {"foo": True}, "anyOf": [{"additionalProperties": True}], "unevaluatedProperties": False},
        id="conditional-additionalProperties",
    ),
    pytest.param({"$dynamicRef": "#meta", "unevaluatedProperties": False}, id="dynamicRef"),
    pytest.param({"$ref": "https://example.com/s.json", "unevaluatedProperties": False}, id="ref-out-of-document"),
    pytest.param(
        {
            "$defs": {"e": {"$id": "https://example.com/e", "properties": {"foo": True}}},
            "$ref": "#/$defs/e",
            "unevaluatedProperties": False,
        },
        id="embedded-resource",
    ),
    pytest.param(
        {"properties": {"foo": {"$ref": "#/unevaluatedProperties"}}, "unevaluatedProperties": {"type": "string"}},
        id="a-ref-points-through-it",
    ),
]


@pytest.mark.parametrize("schema", NOT_REWRITTEN)
def test_where_the_evaluated_keys_depend_on_the_value_it_stays(schema: dict[str, Any]) -> None:
    assert not closed(schema)
    assert "unevaluatedProperties" in relax(schema, STYLE).keywords


def test_llguidance_enforces_the_rewrite() -> None:
    schema = {
        "type": "object",
        "properties": {"foo": {"type": "string"}},
        "required": ["foo"],
        "$ref": "#/$defs/ext",
        "$defs": {"ext": EXT},
        "unevaluatedProperties": False,
    }
    relaxed = relax(schema, STYLE)
    assert relaxed.keywords == ()
    assert accepts(relaxed.schema, '{"foo":"a","x-b":1}')
    assert not accepts(relaxed.schema, '{"foo":"a","bar":1}')
    assert not accepts(relaxed.schema, '{"foo":"a","":1}')


def test_openapi_3_1_is_closed_where_its_keys_are_known() -> None:
    """Of its 28 objects under unevaluatedProperties, the three whose conditionals name keys of their own stay
    relaxed (security schemes by type, parameters and headers by their `schema` / `content`)."""
    schema = json.loads((CORPUS / "openapi" / "openapi-v3.1.json").read_text())
    text = json.dumps(rewrite(schema))
    assert text.count('"unevaluatedProperties"') == 3
    relaxed = relax(schema, STYLE)
    assert not accepts(relaxed.schema, '{"openapi":"3.1.0","info":{"title":"t","version":"1"},"paths":{},"":1}')
    assert accepts(relaxed.schema, '{"openapi":"3.1.0","info":{"title":"t","version":"1","x-a":1},"paths":{}}')


@pytest.mark.parametrize("schema", NOT_REWRITTEN[:4])
def test_forced_there_the_rewrite_would_change_the_documents(
    schema: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check above can fail: with the coverage test skipped, these rewrites accept other documents."""
    monkeypatch.setattr(unevaluated, "_covered", lambda found: True)
    with pytest.raises(AssertionError):
        same_documents(schema, only_this(schema))


def test_a_draft_without_the_keyword_is_left_alone() -> None:
    """Drafts 3 to 7 have no unevaluatedProperties: closing the object there would refuse documents they accept."""
    schema = {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "properties": {"a": True},
        "unevaluatedProperties": False,
    }
    assert not closed(schema)
    assert accepts(relax(schema, STYLE).schema, '{"a":1,"b":2}')
