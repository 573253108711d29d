"""Best effort for JSON schemas (engine/structured/relaxed_schema.py): each relaxation names what it left out, the
relaxed
grammar still enforces the rest, exact rewrites relax nothing, and what no relaxation can fix stays an error."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import llguidance
import pytest

from engine.structured.grammar import GrammarError
from engine.structured.ref_intersections import distribute_siblings
from engine.structured.relaxed_schema import BEST_EFFORT, relax, warning_keywords

STYLE: Any = {"whitespace_flexible": False}
CORPUS = Path(__file__).resolve().parents[3] / "bench" / "schemas"


def accepts(schema: Any, text: str) -> bool:
    """The grammar of `schema` (as relax returned it) takes exactly `text` (bytes through the regex-free path)."""
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=STYLE)
    tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTok()))
    m = llguidance.LLMatcher(tok, grammar, log_level=0)
    return bool(m.consume_tokens(list(text.encode()))) and m.is_accepting()


class _ByteTok:
    """A byte-level tokenizer (one token per byte, eos 256) for checking what a grammar accepts."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
    special_token_ids = [256]

    def __call__(self, s: str | bytes) -> list[int]:
        return list(s.encode() if isinstance(s, str) else s)


@pytest.mark.parametrize(
    "schema, keywords",
    [
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, ("uniqueItems",)),
        ({"type": "object", "propertyNames": {"pattern": "^a"}}, ("propertyNames",)),
        ({"type": "object", "dependencies": {"a": 3}}, ("dependencies",)),  # malformed: not rewritten (test_exact.py)
        ({"not": {"type": "string"}}, ("not",)),
        ({"if": {"type": "string"}, "then": {"minLength": 2}, "else": {"type": "integer"}}, ("else", "if", "then")),
        (
            {"type": "object", "properties": {"a": {"type": "string"}}, "maxProperties": 1},
            ("minProperties/maxProperties",),
        ),
        ({"type": "string", "format": "url"}, ("format:url",)),
        (
            {
                "oneOf": [
                    {"type": "object", "properties": {"a": {"type": "string"}}},
                    {"type": "object", "properties": {"b": {"type": "string"}}},
                ]
            },
            ("oneOf",),
        ),
        ({"type": "string", "pattern": "^(?!foo).*$"}, ("pattern",)),  # look-around: llguidance's regex has none
        (
            {"type": "object", "patternProperties": {"^a": {"type": "string"}, "^ab": {"type": "integer"}}},
            ("patternProperties",),
        ),  # overlapping patterns: llguidance needs them disjoint
        ({"properties": {"a": {"$ref": "#/definitions/missing"}}}, ("$ref",)),
        ({"properties": {"a": {"$ref": "https://example.com/other.json#/x"}}}, ("$ref",)),  # never fetched
    ],
)
def test_each_relaxation_is_named(schema: dict[str, Any], keywords: tuple[str, ...]) -> None:
    out = relax(schema, STYLE)
    assert out.keywords == keywords
    assert out.schema["x-guidance"] == BEST_EFFORT and "x-guidance" not in schema  # the input is not changed


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"a": {"type": "string", "format": "email"}}, "required": ["a"]},
        {"anyOf": [{"type": "string"}, {"type": "boolean"}]},
        {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}}}, "$ref": "#/$defs/n"},
    ],
)
def test_what_is_enforced_whole_is_returned_as_is(schema: dict[str, Any]) -> None:
    out = relax(schema, STYLE)
    assert out.keywords == () and out.schema is schema


def test_exact_rewrites_relax_nothing() -> None:
    """An integral float count (JSON Schema's integer, not llguidance's), a dialect llguidance does not know and
    annotations beside a recursive $ref are rewritten, not relaxed."""
    out = relax({"type": "array", "items": {"type": "string"}, "minItems": 1.0}, STYLE)
    assert out.keywords == () and out.schema["minItems"] == 1 and isinstance(out.schema["minItems"], int)
    out = relax({"$schema": "http://json-schema.org/schema#", "type": "string"}, STYLE)
    assert out.keywords == () and "$schema" not in out.schema
    circle = json.loads((CORPUS / "check-jsonschema" / "circle-ci.json").read_text())
    logic = {"definitions": {"logic": circle["definitions"]["logic"]}, "$ref": "#/definitions/logic"}
    out = relax(logic, STYLE)  # recursive, with annotations beside its $refs: llguidance refuses it as it is
    assert "$ref" not in out.keywords and out.keywords == ("oneOf", "propertyNames")
    nots = out.schema["definitions"]["logic"]["oneOf"][1]["properties"]["not"]
    assert nots == {"$ref": "#/definitions/logic"}


def test_what_is_not_relaxed_is_still_enforced() -> None:
    schema = {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 1, "pattern": "^[ab]$"},
                "uniqueItems": True,
            }
        },
        "required": ["tags"],
        "additionalProperties": False,
    }
    out = relax(schema, STYLE)
    assert out.keywords == ("uniqueItems",)
    assert accepts(out.schema, '{"tags":["a","a"]}')  # uniqueItems: relaxed
    assert not accepts(out.schema, '{"tags":["c"]}')  # pattern: enforced
    assert not accepts(out.schema, '{"tags":[],"x":1}')  # additionalProperties: enforced
    assert not accepts(out.schema, "{}")  # required: enforced


def test_an_optional_part_behind_a_missing_ref_is_left_out() -> None:
    """The output never reaches a schema nobody can read: optional properties and items behind a $ref to nowhere
    are `false`; a required one matches anything."""
    schema = {
        "type": "object",
        "required": ["b"],
        "properties": {
            "a": {"$ref": "#/definitions/missing"},
            "b": {"$ref": "#/definitions/gone"},
            "c": {"type": "array", "items": {"$ref": "other.json#/x"}},
        },
    }
    out = relax(schema, STYLE)
    assert out.keywords == ("$ref",)
    assert accepts(out.schema, '{"b":[1]}') and accepts(out.schema, '{"b":1,"c":[]}')
    assert not accepts(out.schema, '{"a":1,"b":1}') and not accepts(out.schema, '{"b":1,"c":[1]}')


def test_a_recursive_ref_with_siblings_is_folded_into_a_copy() -> None:
    """llguidance cannot intersect a recursive $ref with a sibling `type`: the $ref goes to a copy of the definition
    that holds the sibling (exact), and the document's definitions beside the root's $ref stay (dropping them left
    the whole schema matching anything)."""
    schema = {
        "$ref": "#/definitions/node",
        "definitions": {
            "node": {
                "type": "object",
                "required": ["kids"],
                "properties": {"kids": {"type": "array", "items": {"$ref": "#/definitions/node", "minProperties": 1}}},
            }
        },
    }
    out = relax(schema, STYLE)
    assert out.keywords == () and "definitions" in out.schema
    assert accepts(out.schema, '{"kids":[{"kids":[]}]}')
    assert not accepts(out.schema, "[1]") and not accepts(out.schema, '{"kids":[1]}')
    dart = json.loads((CORPUS / "schemastore" / "dart-test.json").read_text())  # allOf of a recursive $ref and more
    assert relax(dart, STYLE).keywords == ()  # its oneOf too: told apart (engine/structured/one_of.py)


def test_a_definition_with_a_ref_of_its_own_is_folded_too() -> None:
    """OpenAPI 3.1's path item: a recursive definition beside its own `$ref` (to the `x-` extensions) met through a
    branch holding more; folded into a copy (exact) rather than its sibling dropped (relaxed, the branch open)."""
    schema = {
        "$ref": "#/definitions/node",
        "definitions": {
            "named": {"properties": {"name": {"type": "string"}}},
            "node": {
                "type": "object",
                "$ref": "#/definitions/named",
                "required": ["kids"],
                "properties": {
                    "kids": {"type": "array", "items": {"$ref": "#/definitions/node", "required": ["name"]}}
                },
            },
        },
    }
    out = relax(schema, STYLE)
    assert out.keywords == ()
    assert accepts(out.schema, '{"kids":[{"name":"a","kids":[]}]}') and accepts(out.schema, '{"kids":[]}')
    assert not accepts(out.schema, '{"kids":[{"kids":[]}]}') and not accepts(
        out.schema, '{"kids":[{"name":1,"kids":[]}]}'
    )


@pytest.mark.parametrize(
    "schema, needle",
    [
        ({"type": "strin"}, "strin"),  # not a schema
        ({"type": "integer", "minimum": 5, "maximum": 1}, "Unsatisfiable"),
        ({"allOf": [{"type": "string"}, {"type": "integer"}]}, ""),  # nothing satisfies both
    ],
)
def test_what_no_relaxation_fixes_stays_an_error(schema: dict[str, Any], needle: str) -> None:
    with pytest.raises(GrammarError) as e:
        relax(schema, STYLE)
    assert needle in str(e.value)


def test_warning_keywords() -> None:
    assert warning_keywords('Unimplemented keys: ["else", "if"]') == ["else", "if"]
    assert warning_keywords("Unknown format: uri-template") == ["format:uri-template"]
    assert warning_keywords("oneOf not fully supported, falling back to anyOf.") == ["oneOf"]
    assert warning_keywords("something new\x00 <here>") == ["something new here"]  # header-safe


@pytest.mark.parametrize(
    "dialect, kept",
    [("http://json-schema.org/draft-07/schema#", False), ("https://json-schema.org/draft/2020-12/schema", True)],
)
def test_beside_a_recursive_ref_drafts_up_to_7_ignore_what_later_ones_fold(dialect: str, kept: bool) -> None:
    """Drafts 3 to 7 ignore a $ref's siblings (so does the output check): dropped there, exact; folded later."""
    schema = {
        "$schema": dialect,
        "$ref": "#/definitions/node",
        "definitions": {
            "node": {
                "type": "object",
                "properties": {
                    "kids": {"type": "array", "items": {"$ref": "#/definitions/node", "required": ["kids"]}}
                },
            }
        },
    }
    out = relax(schema, STYLE)
    assert out.keywords == ()
    assert accepts(out.schema, '{"kids":[{"kids":[]}]}')
    assert accepts(out.schema, '{"kids":[{}]}') is not kept


def test_an_any_of_beside_a_recursive_ref_takes_its_siblings_into_its_branches() -> None:
    """JSONSchemaBench's Washington Post schemas: `{"anyOf": [{"$ref": T}, ...], "type": "object"}` inside T was a
    refusal (llguidance cannot intersect the recursion with `type`); the siblings go into each branch and the
    branch to T is folded: exact, nothing relaxed."""
    schema = {
        "$schema": "http://json-schema.org/draft-04/schema#",
        "$ref": "#/definitions/node",
        "definitions": {
            "node": {
                "type": "object",
                "properties": {
                    "kid": {"anyOf": [{"$ref": "#/definitions/node"}, {"type": "string"}], "required": ["kid"]}
                },
            }
        },
    }
    out = relax(schema, STYLE)
    assert out.keywords == ()
    assert accepts(out.schema, '{"kid":{"kid":"b"}}') and accepts(out.schema, '{"kid":"a"}')
    assert not accepts(out.schema, '{"kid":{}}') and not accepts(out.schema, '{"kid":1}')


def test_a_property_a_pattern_also_governs_is_dropped_or_closed_beside_a_recursive_ref() -> None:
    """A `properties` entry whose name a `patternProperties` regex matches is intersected with the pattern's schema:
    with a recursive $ref inside that was a refusal. The same schema as the pattern's goes (exact); an optional one
    that differs becomes `false` (fewer answers, all valid); nothing relaxed."""
    branch = {"anyOf": [{"$ref": "#/definitions/node"}, {"type": "string"}]}
    schema = {
        "$ref": "#/definitions/node",
        "definitions": {
            "node": {
                "type": "object",
                "patternProperties": {"^[a-z]*": branch},
                "properties": {"same": branch, "by": {"type": "string", "maxLength": 3}},
            }
        },
    }
    out = relax(schema, STYLE)
    assert out.keywords == ()
    assert accepts(out.schema, '{"same":{"x":"a"}}') and accepts(out.schema, '{"x":{"same":"b"}}')
    assert not accepts(out.schema, '{"by":"a"}') and not accepts(out.schema, '{"same":1}')


def test_a_number_bounded_past_1e19_is_narrowed_not_refused() -> None:
    """SchemaStore's venvironment: `maximum: 1.7976931348623157e308` (the largest double) was a refusal
    (llguidance cannot write that float range's regex); the bound becomes 1e18: fewer values, all valid."""
    schema = {
        "type": "object",
        "properties": {"step": {"type": "number", "minimum": 0, "maximum": 1.7976931348623157e308}},
    }
    out = relax(schema, STYLE)
    assert out.keywords == ()
    assert accepts(out.schema, '{"step":2.5}') and accepts(out.schema, '{"step":1000000}')
    assert not accepts(out.schema, '{"step":-1}')
    low = relax({"type": "number", "exclusiveMinimum": -1e300, "exclusiveMaximum": 3}, STYLE).schema
    assert accepts(low, "-5") and not accepts(low, "3")


def test_an_unsatisfiable_definition_behind_an_optional_member_is_false_not_a_refusal() -> None:
    """JSONSchemaBench's Atom feed schemas: a definition of `type: object` whose oneOf holds only strings meets no
    value, and llguidance refused the whole schema; its $refs become `false` (exact), so the optional member that
    reaches it is left out and the rest is enforced."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "kind": {"$ref": "#/definitions/never"}},
        "required": ["name"],
        "definitions": {"never": {"type": "object", "oneOf": [{"type": "string"}, {"enum": ["a", "b"]}]}},
    }
    out = relax(schema, STYLE)
    assert out.keywords == ()
    assert accepts(out.schema, '{"name":"x"}')
    assert not accepts(out.schema, '{"name":"x","kind":{}}') and not accepts(out.schema, '{"name":"x","kind":"a"}')
    with pytest.raises(GrammarError):
        relax({**schema, "required": ["name", "kind"]}, STYLE)


def test_min_and_max_properties_of_a_closed_object_are_any_ofs_of_key_sets() -> None:
    """JSONSchemaBench Github_medium o8454: minProperties 2 / maxProperties 5 over six optional closed keys was a
    refusal (llguidance counts required keys only); at least two present is an anyOf of required pairs, at most
    so many an anyOf of keys left out, a maxProperties no answer can pass dropped: exact, nothing relaxed."""
    props = {k: {"type": "string"} for k in "abcd"}
    schema = {
        "type": "object",
        "minProperties": 2,
        "maxProperties": 3,
        "additionalProperties": False,
        "properties": props,
    }
    out = relax(schema, STYLE)
    assert out.keywords == ()
    assert accepts(out.schema, '{"a":"x","c":"y"}') and accepts(out.schema, '{"a":"x","b":"y","d":"z"}')
    assert not accepts(out.schema, '{"b":"x"}') and not accepts(out.schema, "{}")
    assert not accepts(out.schema, '{"a":"x","b":"y","c":"z","d":"w"}')
    with_required = relax({**schema, "required": ["a"], "maxProperties": 4}, STYLE)
    assert with_required.keywords == ()
    assert accepts(with_required.schema, '{"a":"x","b":"y"}') and not accepts(with_required.schema, '{"a":"x"}')
    assert accepts(with_required.schema, '{"a":"x","b":"y","c":"z","d":"w"}')


def test_an_id_outside_drafts_3_and_4_is_no_base_uri() -> None:
    """JSONSchemaBench Github_medium o47944 names no draft (2020-12, where `id` is no keyword) and has a definition
    with a draft-4 `$schema` and `id: schema/resource`, whose `$ref`s llguidance resolved against that missing
    document: a refusal. The `id` goes (exact, as the output check reads it); a property named `id` stays; in a
    draft-4 document the id is kept and means what it says."""
    schema = {
        "properties": {"r": {"$ref": "#/definitions/res"}, "id": {"type": "integer"}},
        "required": ["r", "id"],
        "definitions": {
            "res": {
                "$schema": "http://json-schema.org/draft-04/schema#",  # inside: no keyword to the root's draft
                "id": "schema/resource",
                "type": "object",
                "required": ["n"],
                "properties": {"n": {"$ref": "#/definitions/res/definitions/num"}},
                "definitions": {"num": {"type": "integer"}},
            }
        },
    }
    out = relax(schema, STYLE)
    assert out.keywords == ()
    assert accepts(out.schema, '{"r":{"n":1},"id":2}') and not accepts(out.schema, '{"r":{"n":"x"},"id":2}')
    assert not accepts(out.schema, '{"r":{"n":1},"id":"x"}')
    with pytest.raises(GrammarError):
        relax({"$schema": "http://json-schema.org/draft-04/schema#", **schema}, STYLE)


def test_unevaluated_properties_beside_a_recursive_any_of_stay_where_they_see_its_branches() -> None:
    """`unevaluatedProperties` sees the keys an anyOf's branches evaluate: moved into each branch beside them it
    would see only its own node's, and refuse keys the branch allows; so it is not moved (the schema is then
    handled as before: relaxed, never read narrower)."""
    node = {"anyOf": [{"$ref": "#/$defs/t"}], "unevaluatedProperties": False, "type": "object"}
    assert not distribute_siblings([node], "#/$defs/t", frozenset())
    assert set(node) == {"anyOf", "unevaluatedProperties", "type"}
