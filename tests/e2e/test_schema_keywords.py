"""JSON Schema keyword families on the real server with the random-weight model (one server, default flags):
each family is enforced (no relaxation header), and every answer validates with jsonschema and ends "stop".
Then best effort end to end: what is relaxed is named in the response header, strict refuses it, the answers
are checked afterwards (/metrics), tool parameters get the same treatment, and a hostile schema is refused in
bounded time with the server unaffected."""

from __future__ import annotations

import ipaddress
import json
import time
import uuid
from collections.abc import Iterator
from datetime import date, datetime
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from tests.e2e.conftest import Server, start_server

HEADER = "x-structured-output-relaxed"
MSGS = [{"role": "user", "content": "Answer in JSON."}]
CORPUS = Path(__file__).resolve().parents[2] / "bench" / "schemas"
POINT = {
    "type": "object",
    "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
    "required": ["x", "y"],
    "additionalProperties": False,
}
FORMATS = ("date-time", "date", "time", "email", "uri", "uuid", "ipv4", "ipv6")

FAMILIES: dict[str, Any] = {
    "ref_defs": {
        "$defs": {"pt": POINT},
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
    "ref_definitions": {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "definitions": {"pt": POINT},
        "type": "array",
        "items": {"$ref": "#/definitions/pt"},
        "maxItems": 3,
    },
    "recursion": {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "v": {"type": "integer"},
                    "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
                },
                "required": ["v"],
                "additionalProperties": False,
            }
        },
        "$ref": "#/$defs/node",
    },
    "additional_default": {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]},
    "additional_schema": {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 3},
    "pattern_properties": {
        "type": "object",
        "patternProperties": {"^x_[a-z]+$": {"type": "integer"}},
        "additionalProperties": False,
    },
    "prefix_items": {
        "type": "array",
        "prefixItems": [{"type": "string"}, {"type": "integer"}],
        "items": {"type": "boolean"},
        "minItems": 2,
    },
    "items_array": {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "type": "array",
        "items": [{"type": "string", "maxLength": 8}, {"type": "integer"}],
        "additionalItems": False,
    },
    "const_enum_objects": {
        "type": "object",
        "properties": {
            "mode": {"const": {"k": 1, "v": [True, None]}},
            "pick": {"enum": [{"a": 1}, {"b": [2, 3]}, "z", None]},
        },
        "required": ["mode", "pick"],
        "additionalProperties": False,
    },
    "nullable": {
        "type": "object",
        "properties": {
            "a": {"type": ["string", "null"], "maxLength": 6},
            "b": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
        },
        "required": ["a", "b"],
        "additionalProperties": False,
    },
    "formats": {
        "type": "object",
        "properties": {f: {"type": "string", "format": f} for f in FORMATS},
        "required": list(FORMATS),
        "additionalProperties": False,
    },
    # what lenient mode would relax, rewritten exactly (engine/structured/strict_schema.py)
    "conditionals": {
        "type": "object",
        "additionalProperties": False,
        "required": ["type"],
        "properties": {
            "type": {"enum": ["upload", "text", "other"]},
            "attributes": {"type": "object"},
            "id": {"type": "string", "maxLength": 4},
        },
        "allOf": [
            {"if": {"properties": {"type": {"const": "upload"}}}, "then": {"required": ["attributes"]}},
            {
                "if": {"properties": {"type": {"const": "text"}}},
                "then": {"required": ["id"]},
                "else": {"properties": {"id": False}},
            },
        ],
    },
    "dependencies": {
        "type": "object",
        "properties": {"card": {"type": "integer"}, "billing": {"type": "string"}},
        "dependentRequired": {"card": ["billing"]},
        "required": ["card"],
    },
    "unique_enum": {
        "type": "array",
        "items": {"enum": ["http", "https", "ws", "wss"]},
        "uniqueItems": True,
        "minItems": 2,
    },
    "safe_integer": {
        "type": "object",
        "properties": {"n": {"type": "integer", "multipleOf": 1e-08}},
        "required": ["n"],
        "additionalProperties": False,
    },
    # strings whose way out no single character shows: the finish tries samples of the patterns
    "pattern_strings": {
        "type": "object",
        "required": ["icon", "ctx", "mail"],
        "additionalProperties": False,
        "properties": {
            "icon": {"type": "string", "pattern": "\\.png$"},
            "ctx": {"type": "string", "pattern": "http://schema.org"},
            "mail": {"type": "string", "pattern": "^[\\S]+@[\\S]+\\.[\\S]{2,}$"},
        },
    },
}


@pytest.fixture(scope="module")
def srv(qwen2_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(qwen2_ckpt, tmp_path_factory.mktemp("keywords"), env={"SPINDLE_STRUCTURED_OUTPUTS_WARMUP": "1"})
    yield s
    s.stop()


def ask(
    srv: Server,
    schema: Any,
    *,
    strict: bool | None = None,
    max_tokens: int = 200,
    n: int = 2,
    seed: int = 7,
    **extra: Any,
) -> httpx.Response:
    fmt: dict[str, Any] = {"name": "answer", "schema": schema}
    if strict is not None:
        fmt["strict"] = strict
    body = {
        "model": "tiny",
        "messages": MSGS,
        "max_tokens": max_tokens,
        "n": n,
        "seed": seed,
        "temperature": 1.0,
        "response_format": {"type": "json_schema", "json_schema": fmt},
        **extra,
    }
    return httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=120)


def check_formats(value: dict[str, str]) -> None:
    """What jsonschema's format checker may skip (its optional dependencies), checked by hand."""
    datetime.fromisoformat(value["date-time"].replace("Z", "+00:00"))
    date.fromisoformat(value["date"])
    assert ":" in value["time"] and value["time"][:2].isdigit()
    local, _, domain = value["email"].partition("@")
    assert local and domain
    assert ":" in value["uri"]
    uuid.UUID(value["uuid"])
    ipaddress.IPv4Address(value["ipv4"])
    ipaddress.IPv6Address(value["ipv6"])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_keyword_family_is_enforced_and_validates(srv: Server, family: str) -> None:
    schema = FAMILIES[family]
    r = ask(srv, schema)
    assert r.status_code == 200, r.text
    assert HEADER not in r.headers  # enforced whole: nothing relaxed
    cls = jsonschema.validators.validator_for(schema)
    validator = cls(schema, format_checker=cls.FORMAT_CHECKER)  # the draft's formats (FormatChecker(): draft 3's too)
    for choice in r.json()["choices"]:
        text = choice["message"]["content"]
        assert choice["finish_reason"] == "stop", text
        value = json.loads(text)
        validator.validate(value)
        if family == "formats":
            check_formats(value)


def test_strict_families_are_accepted_strict_too(srv: Server) -> None:
    for family in ("ref_defs", "recursion", "const_enum_objects", "formats"):
        assert ask(srv, FAMILIES[family], strict=True, max_tokens=16, n=1).status_code == 200, family


RELAXED = {
    "type": "object",
    "properties": {
        "tags": {
            "type": "array",
            "items": {"type": "string", "pattern": "^[abc]$"},
            "uniqueItems": True,
            "maxItems": 3,
        },
        "kind": {
            "oneOf": [
                {"type": "object", "properties": {"x": {"type": "integer"}}, "additionalProperties": False},
                {"type": "object", "properties": {"y": {"type": "integer"}}, "additionalProperties": False},
            ]
        },
        "home": {"type": "string", "format": "url", "maxLength": 20},
    },
    "required": ["tags", "kind", "home"],
    "additionalProperties": False,
}


def test_best_effort_names_what_it_relaxed_and_checks_the_answers(srv: Server) -> None:
    before = srv.metric("spindle_structured_output_checked_total")
    r = ask(srv, RELAXED, n=3)
    assert r.status_code == 200, r.text
    assert r.headers[HEADER] == "format:url, uniqueItems"  # kind's oneOf: narrowed to branches told apart
    finished = 0
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "stop"
        value = json.loads(choice["message"]["content"])
        assert set(value) == {"tags", "kind", "home"} and set(value["tags"]) <= {"a", "b", "c"}  # enforced parts
        assert len(value["kind"]) == 1  # exactly one branch: x or y
        finished += 1
    invalid = sum(
        srv.metric("spindle_structured_output_invalid_total", f'reason="{k}"')
        for k in ("uniqueItems", "oneOf", "format")
    )
    assert srv.metric("spindle_structured_output_checked_total") == before + finished
    assert invalid <= finished
    refused = ask(srv, RELAXED, strict=True)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "response_format.json_schema.schema"
    assert "uniqueItems" in refused.json()["error"]["message"] or "Unknown format" in refused.json()["error"]["message"]


def test_streamed_best_effort_has_the_header_and_is_checked(srv: Server) -> None:
    before = srv.metric("spindle_structured_output_checked_total")
    body = {
        "model": "tiny",
        "messages": MSGS,
        "max_tokens": 120,
        "stream": True,
        "seed": 3,
        "structured_outputs": {"json": RELAXED},
    }
    with httpx.stream("POST", f"{srv.url}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers[HEADER] == "format:url, uniqueItems"
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert set(json.loads(text)) == {"tags", "kind", "home"}
    assert srv.metric("spindle_structured_output_checked_total") == before + 1


def test_tool_parameters_are_best_effort_unless_strict(srv: Server) -> None:
    def call(strict: bool | None) -> httpx.Response:
        fn: dict[str, Any] = {"name": "tag", "parameters": RELAXED}
        if strict is not None:
            fn["strict"] = strict
        body = {
            "model": "tiny",
            "messages": MSGS,
            "max_tokens": 120,
            "seed": 5,
            "tools": [{"type": "function", "function": fn}],
            "tool_choice": {"type": "function", "function": {"name": "tag"}},
        }
        return httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=120)

    r = call(None)
    assert r.status_code == 200, r.text
    assert r.headers[HEADER] == "tag(format:url, uniqueItems)"
    calls = r.json()["choices"][0]["message"]["tool_calls"]
    assert calls[0]["function"]["name"] == "tag"
    assert set(json.loads(calls[0]["function"]["arguments"])) == {"tags", "kind", "home"}
    refused = call(True)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools"


def test_a_one_of_whose_branches_may_overlap_is_refused_for_the_answer(srv: Server) -> None:
    """Read as anyOf, an answer could meet both branches: response_format refuses it (400 naming oneOf and where),
    with anyOf the same schema is enforced whole."""
    overlap = {"type": "object", "properties": {"n": {"oneOf": [{"type": "number"}, {"type": "integer"}]}}}
    r = ask(srv, overlap, n=1)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format.json_schema.schema"
    assert "oneOf at /properties/n" in r.json()["error"]["message"]
    either = {"type": "object", "properties": {"n": {"anyOf": [{"type": "number"}, {"type": "integer"}]}}}
    ok = ask(srv, either, n=1)
    assert ok.status_code == 200 and HEADER not in ok.headers


def test_a_large_real_schema_passes_the_default_budget(srv: Server) -> None:
    def size(schema: Any) -> int:  # as the server counts it: the compact JSON text's bytes
        return len(json.dumps(schema, separators=(",", ":"), ensure_ascii=False).encode())

    schema = max((json.loads(p.read_text()) for p in CORPUS.glob("*/*.json")), key=size)
    assert 150_000 < size(schema) <= 256 << 10  # over 64 KiB, within the default 256 KiB
    r = ask(srv, schema, n=1, max_tokens=384)  # a deep schema: its shortest finish takes more tokens
    assert r.status_code == 200, r.text[:500]
    assert r.json()["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(
    "schema, needle",
    [
        (
            {
                "allOf": [
                    {"anyOf": [{"type": "object", "properties": {f"k{i}{j}": {"type": "integer"}}} for j in range(6)]}
                    for i in range(6)
                ]
            },
            "too large",
        ),  # the intersection would have 6^6 branches
        ({"type": "object", "properties": {"a": {"enum": [f"value-{i}" for i in range(1500)]}}}, ""),  # fits
    ],
)
def test_a_hostile_schema_is_refused_in_bounded_time(srv: Server, schema: Any, needle: str) -> None:
    t0 = time.monotonic()
    r = ask(srv, schema, n=1, max_tokens=8)
    assert time.monotonic() - t0 < 30
    if needle:
        assert r.status_code == 400 and needle in r.json()["error"]["message"]
    else:
        assert r.status_code == 200
    assert httpx.get(f"{srv.url}/health", timeout=5).status_code == 200
