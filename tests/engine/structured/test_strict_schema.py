"""Exact rewrites before lenient mode (engine/structured/strict_schema.py): each keeps the schema's valid values or
fewer,
checked against jsonschema (the output check's judge) on many instances, and llguidance enforces the result."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from engine.structured.relaxed_schema import relax
from engine.structured.strict_schema import FORMATS, negate, other_strings, rewrite
from tests.engine.structured.test_relaxed_schema import STYLE, accepts

CORPUS = Path(__file__).resolve().parents[3] / "bench" / "schemas"
DRAFT7 = "http://json-schema.org/draft-07/schema#"
CHECKER = jsonschema.Draft202012Validator.FORMAT_CHECKER
DATES = [
    "2024-02-29",
    "2023-02-29",
    "2000-02-29",
    "1900-02-29",
    "0400-02-29",
    "0000-01-01",
    "0001-01-01",
    "9999-12-31",
    "2023-04-31",
    "2023-04-30",
    "2023-13-01",
    "2023-00-10",
    "2023-01-00",
    "2023-1-01",
    "20230101",
    "2023-02-28",
    "1996-02-29",
    "2100-02-29",
    "2023-06-15x",
]
TIMES = [
    "23:59:59Z",
    "23:59:60Z",
    "24:00:00Z",
    "12:00:00z",
    "12:00:00+23:59",
    "12:00:00+24:00",
    "12:00:00-05:30",
    "12:00:00.123456Z",
    "12:00:00.Z",
    "12:00:00",
    "12:60:00Z",
    "1:00:00Z",
    "12:00:00+0530",
]


def valid(instance: Any, schema: Any) -> bool:
    """As the output check judges: the schema's own dialect ($schema), 2020-12 without one."""
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return bool(cls(schema, format_checker=CHECKER).is_valid(instance))


@pytest.mark.parametrize(
    "fmt, samples",
    [
        ("date", DATES),
        ("time", TIMES),
        ("date-time", [f"{d}{t}{z}" for d in DATES[:12] for t in ("T", "t", " ") for z in TIMES[:8]]),
    ],
)
def test_format_patterns_equal_the_output_checks_format_checker(fmt: str, samples: list[str]) -> None:
    pattern = FORMATS[fmt]
    for s in samples:
        assert bool(re.search(pattern, s)) == CHECKER.conforms(s, fmt), (fmt, s)


# RFC 6901, labelled by hand (jsonschema checks the format only where the optional jsonpointer package is installed)
POINTERS = {"": True, "/": True, "/a": True, "/a/b": True, "/a~0b": True, "/a~1b": True, "//": True, "/~01": True}
POINTERS |= {"/é/ü": True, "a": False, "/~": False, "/~2": False, "~0": False, "/a~": False, "#": False}


def test_the_json_pointer_pattern_is_rfc_6901() -> None:
    assert {s: bool(re.search(FORMATS["json-pointer"], s)) for s in POINTERS} == POINTERS


def test_the_relative_json_pointer_pattern_takes_a_count_then_a_pointer_or_hash() -> None:
    """Draft 2019-09's form; 2020-12's +n/-n index shift is left out (fewer answers, each one valid)."""
    for count, counted in {"0": True, "1": True, "12": True, "01": False, "": False, "-1": False}.items():
        for tail, ok in {**POINTERS, "#": True}.items():  # "#" alone: the value's key or index
            s = count + tail
            assert bool(re.search(FORMATS["relative-json-pointer"], s)) == (counted and ok), s


def test_a_pointer_format_is_enforced_not_relaxed() -> None:
    out = relax({"type": "string", "format": "json-pointer"}, STYLE)
    assert out.keywords == ()
    assert accepts(out.schema, '"/a~1b/0"') and not accepts(out.schema, '"a/b"') and not accepts(out.schema, '"/~2"')


def test_the_format_pattern_is_enforced_beside_the_users_own() -> None:
    out = relax({"type": "string", "format": "date-time"}, STYLE)
    assert out.keywords == ()
    assert accepts(out.schema, '"2024-02-29T23:59:59Z"')
    assert not accepts(out.schema, '"2023-02-29T23:59:59Z"')  # llguidance's own regex takes it
    assert not accepts(out.schema, '"2024-02-28T23:59:60Z"')
    both = relax({"type": "string", "format": "date", "pattern": "^2"}, STYLE)
    assert accepts(both.schema, '"2024-02-29"') and not accepts(both.schema, '"1996-02-29"')


@pytest.mark.parametrize("words", [["upload"], ["up", "upload", "x"], [""], ["a", "b"], ["é", "a-b"]])
def test_other_strings_is_every_string_but_the_words(words: list[str]) -> None:
    regex = re.compile(other_strings(words))
    alphabet = sorted({c for w in words for c in w} | {"z"})
    for n in range(6):
        for chars in itertools.product(alphabet, repeat=n):
            s = "".join(chars)
            assert bool(regex.fullmatch(s)) == (s not in words), (words, s)


INSTANCES = [
    None,
    True,
    False,
    0,
    1.5,
    "",
    "a",
    "upload",
    "text",
    [],
    ["upload"],
    {},
    {"type": "upload"},
    {"type": "text"},
    {"type": 1},
    {"type": None},
    {"kind": "x"},
    {"type": "upload", "kind": "x"},
    {"runs": {"using": "composite"}},
    {"runs": {"using": "node"}},
    {"runs": 3},
    {"runs": {}},
]


@pytest.mark.parametrize(
    "cond",
    [
        True,
        False,
        {"const": "upload"},
        {"enum": ["upload", "text", None, True]},
        {"properties": {"type": {"const": "upload"}}},
        {"properties": {"type": {"const": "upload"}}, "required": ["type"]},
        {"type": "object", "properties": {"type": {"enum": ["upload", "text"]}}},
        {"required": ["kind"]},
        {"properties": {"kind": True}, "required": ["kind"]},
        {"properties": {"runs": {"type": "object", "properties": {"using": {"const": "composite"}}}}},
        {"anyOf": [{"required": ["type"]}, {"required": ["kind"]}]},
        {"allOf": [{"required": ["type"]}, {"properties": {"type": {"const": "text"}}}]},
        {"not": {"required": ["kind"]}},
    ],
)
def test_negate_holds_exactly_where_the_condition_fails(cond: Any) -> None:
    neg = negate(cond)
    assert neg is not None
    for instance in INSTANCES:
        assert valid(instance, neg) == (not valid(instance, cond)), (cond, instance)


@pytest.mark.parametrize(
    "cond",
    [{"type": "string"}, {"const": 3}, {"minimum": 2}, {"$ref": "#/x"}, {"properties": {"a": {"pattern": "^x"}}}],
)
def test_negate_refuses_what_it_cannot_write(cond: Any) -> None:
    assert negate(cond) is None


FORM = {
    "type": "object",
    "additionalProperties": False,
    "required": ["type"],
    "properties": {
        "type": {"enum": ["upload", "text", "other"]},
        "attributes": {"type": "object"},
        "id": {"type": "string"},
    },
    "allOf": [
        {"if": {"properties": {"type": {"const": "upload"}}}, "then": {"required": ["attributes"]}},
        {
            "if": {"properties": {"type": {"const": "text"}}},
            "then": {"required": ["id"]},
            "else": {"properties": {"id": False}},
        },
    ],
}


def test_conditionals_on_one_property_become_one_switch() -> None:
    out = relax(FORM, STYLE)
    assert out.keywords == ()
    for text in [
        '{"type":"upload","attributes":{}}',
        '{"type":"upload"}',
        '{"type":"text","id":"a"}',
        '{"type":"text"}',
        '{"type":"other"}',
        '{"type":"other","id":"a"}',
        '{"type":"upload","attributes":{},"id":"a"}',
    ]:
        assert accepts(out.schema, text) == valid(json.loads(text), FORM), text


def test_a_conditional_outside_the_fragment_is_left_to_lenient_mode() -> None:
    schema = {"if": {"type": "string"}, "then": {"minLength": 2}}
    assert rewrite(schema) is schema
    assert relax(schema, STYLE).keywords == ("if", "then")


def test_property_names_are_not_keywords() -> None:
    """A property named `if`, `format` or `dependencies` is data, not a keyword."""
    schema = {
        "type": "object",
        "properties": {
            "if": {"type": "string"},
            "then": {"type": "boolean"},
            "format": {"const": "date"},
            "dependencies": {"type": "object"},
        },
    }
    assert rewrite(schema) is schema


@pytest.mark.parametrize(
    "schema",
    [
        {"$schema": DRAFT7, "type": "object", "dependencies": {"a": ["b"]}},
        {"type": "object", "dependentRequired": {"a": ["b"]}},
        {"type": "object", "dependentSchemas": {"a": {"required": ["b"]}}},
        {
            "$schema": DRAFT7,
            "type": "object",
            "dependencies": {"a": {"properties": {"b": {"const": 1}}, "required": ["b"]}},
        },
    ],
)
def test_dependencies_are_enforced(schema: dict[str, Any]) -> None:
    out = relax(schema, STYLE)
    assert out.keywords == ()
    for value in [{}, {"b": 1}, {"a": 1}, {"a": 1, "b": 1}, {"a": 1, "b": 2}]:
        orders = [json.dumps(dict(p), separators=(",", ":")) for p in itertools.permutations(value.items())]
        # llguidance fixes the order of an object's keys (declared, then required, then the rest): some order
        assert any(accepts(out.schema, text) for text in orders) == valid(value, schema), (schema, value)


def test_what_llguidance_cannot_take_falls_back_to_lenient_mode() -> None:
    """Eight conditionals on one object of 38 members multiply past llguidance's schema size: relaxed as before.
    Dependabot's, once too large, compile since its restated `schedule` goes: only `not` and `uniqueItems` are left
    to lenient mode."""
    props: dict[str, Any] = {
        f"p{i}": {"type": "object", "properties": {f"q{j}": {"type": "string"} for j in range(10)}} for i in range(30)
    }
    props |= {f"b{i}": {"type": "boolean"} for i in range(8)}
    conds = [
        {
            "if": {"properties": {f"b{i}": {"const": True}}, "required": [f"b{i}"]},
            "then": {"required": [f"p{i}"]},
            "else": {"required": [f"p{i + 10}"]},
        }
        for i in range(8)
    ]
    assert relax({"type": "object", "properties": props, "allOf": conds}, STYLE).keywords == ("else", "if", "then")
    schema = json.loads((CORPUS / "check-jsonschema" / "dependabot.json").read_text())
    assert relax(schema, STYLE).keywords == ("not", "uniqueItems")


def test_an_open_integer_is_bounded_to_the_safe_range() -> None:
    out = relax({"type": "integer", "multipleOf": 1e-08}, STYLE)
    assert out.keywords == ()
    assert accepts(out.schema, "9007199254740991") and accepts(out.schema, "-9007199254740991")
    assert not accepts(out.schema, "9007199254740992") and not accepts(out.schema, "1" * 40)
    low = relax({"type": "integer", "minimum": 5}, STYLE)  # the user's own bound stays, the open side closes
    assert accepts(low.schema, "5") and not accepts(low.schema, "4") and not accepts(low.schema, "1" * 17)
    past = {"type": "integer", "minimum": 2**60}  # past the range: the other side stays open
    assert rewrite(past) is past
    assert rewrite({"type": "integer", "minimum": 0, "maximum": 10**30}) == {
        "type": "integer",
        "minimum": 0,
        "maximum": 10**30,
    }


def test_unique_items_of_a_small_enum_are_listed() -> None:
    schema = {
        "type": "array",
        "items": {"type": "string", "enum": ["http", "https", "ws", "wss", "http"]},
        "uniqueItems": True,
        "minItems": 1,
    }
    out = relax(schema, STYLE)
    assert out.keywords == ()
    for value in (
        ["http"],
        ["http", "ws"],
        ["ws", "http"],
        ["http", "http"],
        [],
        ["x"],
        ["http", "https", "ws", "wss"],
    ):
        text = json.dumps(value, separators=(",", ":"))
        assert not accepts(out.schema, text) or valid(value, schema), value  # nothing the schema refuses
    assert accepts(out.schema, '["http","ws"]') and accepts(out.schema, '["http","https","ws","wss"]')
    big = {"type": "array", "items": {"enum": list(range(9))}, "uniqueItems": True}
    assert relax(big, STYLE).keywords == ("uniqueItems",)  # 2**9 arrays: left to lenient mode


def test_one_of_is_exact_where_the_branches_exclude_each_other() -> None:
    either = {
        "type": "object",
        "properties": {"author": {"type": "string"}, "authors": {"type": "array"}},
        "oneOf": [{"required": ["author"]}, {"required": ["authors"]}],
    }
    out = relax(either, STYLE)
    assert out.keywords == ()
    for text in ['{"author":"a"}', '{"authors":[]}', '{"author":"a","authors":[]}', "{}"]:
        assert accepts(out.schema, text) == valid(json.loads(text), either), text
    tagged = {
        "oneOf": [
            {"type": "object", "required": ["k"], "properties": {"k": {"const": "a"}}},
            {"type": "object", "required": ["k"], "properties": {"k": {"const": "b"}}},
            {"type": "string"},
        ]
    }
    assert relax(tagged, STYLE).keywords == ()
    overlapping = {"oneOf": [{"type": "string", "minLength": 2}, {"type": "string", "maxLength": 4}]}
    assert relax(overlapping, STYLE).keywords == ("oneOf",)


def test_a_keyword_a_ref_points_through_is_left_as_it_is() -> None:
    schema = {
        "properties": {
            "a": {"oneOf": [{"required": ["x"]}, {"required": ["y"]}]},
            "b": {"$ref": "#/properties/a/oneOf/1"},
        }
    }
    assert rewrite(schema) is schema
    named = {
        "definitions": {"if": {"type": "string"}},
        "properties": {"a": {"$ref": "#/definitions/if"}},
        "if": {"properties": {"a": {"const": "x"}}},
        "then": {"required": ["a"]},
    }
    assert "if" not in rewrite(named)  # `if` there names a definition: the conditional is still rewritten


# Dependabot's update entry, cut down: a branch restates a property of the object it sits in (through a $ref)
RESTATED = {
    "definitions": {
        "update": {
            "type": "object",
            "properties": {
                "schedule": {
                    "type": "object",
                    "properties": {"interval": {"enum": ["daily", "cron"]}, "cronjob": {"type": "string"}},
                    "required": ["interval"],
                    "allOf": [
                        {"if": {"properties": {"interval": {"const": "cron"}}}, "then": {"required": ["cronjob"]}}
                    ],
                },
                "directory": {"type": "string"},
                "directories": {"type": "array", "items": {"type": "string"}},
                "group": {"type": "string"},
            },
            "allOf": [
                {
                    "if": {"not": {"properties": {"group": {}}, "required": ["group"]}},
                    "then": {
                        "properties": {"schedule": {"$ref": "#/definitions/update/properties/schedule"}},
                        "required": ["schedule"],
                    },
                },
                {
                    "oneOf": [
                        {
                            "properties": {"directory": {"$ref": "#/definitions/update/properties/directory"}},
                            "required": ["directory"],
                        },
                        {
                            "properties": {"directories": {"$ref": "#/definitions/update/properties/directories"}},
                            "required": ["directories"],
                        },
                    ]
                },
            ],
        }
    },
    "type": "array",
    "items": {"$ref": "#/definitions/update"},
}


def test_a_branch_restating_the_objects_own_property_is_enforced() -> None:
    """The restated $ref goes (exact), so the conditional and the oneOf are rewritten and enforced: none is relaxed,
    and the grammar agrees with jsonschema on each instance."""
    out = relax(RESTATED, STYLE)
    assert out.keywords == ()
    sched = '"schedule":{"interval":"daily"}'
    for text in [
        f'[{{{sched},"directory":"a"}}]',
        '[{"directory":"a"}]',  # no schedule, no group
        '[{"directory":"a","group":"g"}]',
        f'[{{{sched},"directory":"a","directories":[]}}]',  # both: oneOf fails
        '[{"schedule":{"interval":"cron"},"directories":[]}]',  # cron without cronjob
        '[{"schedule":{"interval":"cron","cronjob":"x"},"directories":[]}]',
    ]:
        assert accepts(out.schema, text) == valid(json.loads(text), RESTATED), text


def test_an_entry_that_also_closes_keys_stays() -> None:
    """With additionalProperties beside it, a branch's entry also says `k` is not an additional key: kept."""
    schema = {
        "type": "object",
        "properties": {"k": {"type": "string"}},
        "anyOf": [{"properties": {"k": {"type": "string"}}, "additionalProperties": False}, {"required": ["k"]}],
    }
    assert rewrite(schema) is schema
    loose = {**schema, "anyOf": [{"properties": {"k": {"type": "string"}, "j": {}}}, {"required": ["k"]}]}
    assert rewrite(loose)["anyOf"][0] == {}


UNTYPED = {  # Minecraft's item modifier, cut down: no `type` where the conditionals sit
    "properties": {"function": {"enum": ["a", "b"]}},
    "allOf": [
        {"if": {"properties": {"function": {"const": "a"}}}, "then": {"properties": {"n": {"type": "integer"}}}},
        {"if": {"properties": {"function": {"const": "b"}}}, "then": {"required": ["m"]}},
    ],
}


@pytest.mark.parametrize("then_type", [None, "object"])
def test_a_switch_takes_no_value_the_conditionals_refuse(then_type: str | None) -> None:
    """A value that is no object meets every `if`, so it must meet every `then`: a string met none of a `then` of
    type object, yet the switch let it through (the answer broke `type`, nothing relaxed)."""
    schema = json.loads(json.dumps(UNTYPED))
    if then_type:
        schema["allOf"][0]["then"]["type"] = then_type
    out = rewrite(schema)
    assert "if" not in json.dumps(out)
    for value in [
        "s",
        1,
        None,
        [],
        {},
        {"function": "a", "n": 1},
        {"function": "a", "n": "x"},
        {"function": "b"},
        {"function": "b", "m": 1},
        {"function": "c"},
    ]:
        if isinstance(value, dict) and "function" not in value:
            continue  # the switch leaves out an object without the property (fewer, never more)
        assert valid(value, out) == valid(value, schema), value
