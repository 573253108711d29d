"""Strict vs best effort on the request side (server/structured/constraint.py, tool_schemas.py) and the check of
relaxed answers afterwards (server/structured/output_check.py): what is relaxed is named, strict keeps its 400s,
tools follow their own `strict`, and an answer that breaks its whole schema is counted by reason."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from engine.messages import StructuredOutputs
from server.config import RequestCaps
from server.http.errors import APIError
from server.metrics.prometheus import STRUCTURED_INVALID_REASONS
from server.request.collector import Output
from server.request.openai_protocol import ChatCompletionRequest
from server.structured import constraint as structured
from server.structured.constraint import RELAXED_HEADER, relax_schema, structured_outputs
from server.structured.output_check import OutputCheck, invalid_reason, relaxed_check, relaxed_headers
from server.structured.tool_schemas import relax_tools

CAPS = RequestCaps()
UNIQUE = {
    "type": "object",
    "properties": {
        "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
        "link": {"type": "string", "format": "url"},
    },
    "required": ["tags"],
}


def chat(**fields: Any) -> ChatCompletionRequest:
    return msgspec.json.decode(
        msgspec.json.encode({"messages": [{"role": "user", "content": "x"}], **fields}), type=ChatCompletionRequest
    )


def json_schema(schema: Any, strict: bool | None = None) -> dict[str, Any]:
    fmt: dict[str, Any] = {"name": "x", "schema": schema}
    if strict is not None:
        fmt["strict"] = strict
    return {"type": "json_schema", "json_schema": fmt}


@pytest.fixture(autouse=True)
def fresh_cache() -> Iterator[None]:
    structured.clear_cache()
    yield
    structured.clear_cache()


@pytest.mark.anyio
@pytest.mark.parametrize(
    "fields",
    [
        {"response_format": json_schema(UNIQUE)},
        {"response_format": json_schema(UNIQUE, strict=False)},
        {"structured_outputs": {"json": UNIQUE}},
        {"structured_outputs": {"json": json.dumps(UNIQUE), "disable_any_whitespace": True}},
        {"guided_json": UNIQUE},
    ],
)
async def test_without_strict_the_schema_is_relaxed_and_says_what(fields: dict[str, Any]) -> None:
    found = await structured_outputs(chat(**fields), CAPS)
    assert found is not None and found.relaxed is not None
    assert found.relaxed.keywords == ("format:url", "uniqueItems")
    assert found.relaxed.schema == UNIQUE  # the output is checked against the whole schema
    assert found.relaxed.header() == (RELAXED_HEADER, b"format:url, uniqueItems")
    sent = json.loads(found.so.spec)  # what the engine compiles: llguidance's lenient mode
    assert sent["x-guidance"] == {"lenient": True, "coerce_one_of": True}
    assert {k: v for k, v in sent.items() if k != "x-guidance"} == UNIQUE


@pytest.mark.anyio
async def test_strict_keeps_the_400_naming_the_keyword() -> None:
    with pytest.raises(APIError) as e:
        await structured_outputs(chat(response_format=json_schema(UNIQUE, strict=True)), CAPS)
    assert e.value.status == 400 and e.value.param == "response_format.json_schema.schema"
    assert "uniqueItems" in e.value.message


@pytest.mark.anyio
async def test_a_schema_enforced_whole_is_sent_as_it_is() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string", "format": "email"}}}
    for strict in (None, True):
        found = await structured_outputs(chat(response_format=json_schema(schema, strict)), CAPS)
        assert found is not None and found.relaxed is None
        assert found.so == StructuredOutputs("json", json.dumps(schema, separators=(",", ":")))


@pytest.mark.anyio
async def test_what_no_relaxation_fixes_is_a_400_even_without_strict() -> None:
    for schema, needle in (({"type": "strin"}, "strin"), ({"type": "integer", "minimum": 3, "maximum": 1}, "minimum")):
        with pytest.raises(APIError) as e:
            await structured_outputs(chat(response_format=json_schema(schema)), CAPS)
        assert e.value.param == "response_format.json_schema.schema" and needle in e.value.message


OVERLAP = {
    "type": "object",
    "properties": {"n": {"oneOf": [{"type": "number"}, {"type": "integer", "minimum": 0}]}},
    "required": ["n"],
}


@pytest.mark.anyio
@pytest.mark.parametrize(
    "fields, param",
    [
        ({"response_format": json_schema(OVERLAP)}, "response_format.json_schema.schema"),
        ({"structured_outputs": {"json": OVERLAP}}, "structured_outputs.json"),
        ({"guided_json": OVERLAP}, "guided_json"),
    ],
)
async def test_a_one_of_whose_branches_may_overlap_is_a_400_naming_it(fields: dict[str, Any], param: str) -> None:
    """Read as anyOf, an answer (5) could meet both branches and fail the schema: refused, never a relaxation."""
    with pytest.raises(APIError) as e:
        await structured_outputs(chat(**fields), CAPS)
    assert e.value.status == 400 and e.value.param == param
    assert "oneOf at /properties/n" in e.value.message and "anyOf" in e.value.message
    disjoint = {
        "oneOf": [{"type": "string"}, {"type": "object", "required": ["a"]}, {"type": "object", "required": ["b"]}]
    }
    found = await structured_outputs(chat(response_format=json_schema(disjoint)), CAPS)
    assert found is not None and found.relaxed is None  # told apart: enforced whole
    _, relaxed = await relax_tools([_tool("f", OVERLAP)], CAPS)  # a tool's arguments: relaxed as before
    assert relaxed["f"].keywords == ("oneOf",)


@pytest.mark.anyio
async def test_relaxed_results_are_cached_per_mode() -> None:
    calls: list[Any] = []
    real = structured.backend_relax

    def counting(schema: Any, style: Any) -> Any:
        calls.append(schema)
        return real(schema, style)

    structured.backend_relax = counting
    try:
        for _ in range(2):
            await structured_outputs(chat(guided_json=UNIQUE), CAPS)
        assert len(calls) == 1
        with pytest.raises(APIError):  # strict: its own check, not the relaxed result
            await structured_outputs(chat(response_format=json_schema(UNIQUE, strict=True)), CAPS)
    finally:
        structured.backend_relax = real


@pytest.mark.anyio
async def test_relax_schema_for_tool_parameters_and_its_size_cap() -> None:
    schema, keywords = await relax_schema(UNIQUE, "tools[0].function.parameters", CAPS)
    assert keywords == ("format:url", "uniqueItems") and schema["x-guidance"]["lenient"] is True
    plain = {"type": "object", "properties": {"a": {"type": "boolean"}}}
    assert await relax_schema(plain, "p", CAPS) == (plain, ())
    size = len(json.dumps(plain))
    for cap, ok in ((size, True), (size - 1, False)):
        if ok:
            await relax_schema(plain, "p", RequestCaps(max_structured_output_size=cap))
        else:
            with pytest.raises(APIError) as e:
                await relax_schema(plain, "p", RequestCaps(max_structured_output_size=cap))
            assert "--max-structured-output-size" in e.value.message and e.value.param == "p"


def _tool(name: str, params: Any, strict: bool | None = None) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": name, "parameters": params}
    if strict is not None:
        fn["strict"] = strict
    return {"type": "function", "function": fn}


@pytest.mark.anyio
async def test_tools_are_best_effort_unless_strict() -> None:
    plain = {"type": "object", "properties": {"a": {"type": "integer"}}}
    tools = [_tool("loose", UNIQUE), _tool("tight", UNIQUE, strict=True), _tool("plain", plain)]
    out, relaxed = await relax_tools(tools, CAPS)
    assert list(relaxed) == ["loose"] and relaxed["loose"].keywords == ("format:url", "uniqueItems")
    assert relaxed["loose"].schema == UNIQUE
    assert out[0]["function"]["parameters"]["x-guidance"]["lenient"] is True
    assert out[1] is tools[1] and out[2] is tools[2]  # strict: as given (check_constraint refuses it whole)
    assert tools[0]["function"]["parameters"] == UNIQUE  # the request's tools (rendered) are left alone
    with pytest.raises(APIError) as e:
        await relax_tools([_tool("bad", {"type": "strin"})], CAPS)
    assert e.value.param == "tools[0].function.parameters"


@pytest.mark.anyio
async def test_relaxed_headers_name_response_format_and_tools() -> None:
    found = await structured_outputs(chat(guided_json=UNIQUE), CAPS)
    _, tools = await relax_tools([_tool("f", UNIQUE)], CAPS)
    assert relaxed_headers(found, {}) == [(RELAXED_HEADER, b"format:url, uniqueItems")]
    assert relaxed_headers(None, tools) == [(RELAXED_HEADER, b"f(format:url, uniqueItems)")]
    whole = await structured_outputs(chat(guided_json={"type": "string"}), CAPS)
    assert relaxed_headers(whole, {}) == [] and relaxed_check(None, whole, {}) is None


@pytest.mark.parametrize(
    "value, schema, reason",
    [
        ({"tags": ["a", "b"]}, UNIQUE, None),
        ({"tags": ["a", "a"]}, UNIQUE, "uniqueItems"),
        ({}, UNIQUE, "required"),
        ("x", {"not": {"type": "string"}}, "not"),
        ({"a": 1}, {"if": {"required": ["a"]}, "then": {"required": ["b"]}}, "if"),  # under then: the conditional
        (1, {"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
        ({"Ab": 1}, {"propertyNames": {"pattern": "^[a-z]+$"}}, "propertyNames"),
        ("not an email", {"type": "string", "format": "email"}, "format"),
        ([1], {"contains": {"type": "string"}}, "contains"),
        ({"a": 1}, {"minProperties": 2}, "minProperties"),
        (1, {"multipleOf": 2}, "other"),
    ],
)
def test_invalid_reason_names_the_keyword(value: Any, schema: Any, reason: str | None) -> None:
    assert invalid_reason(value, schema) == reason
    assert reason is None or reason in STRUCTURED_INVALID_REASONS


class _Metrics:
    def __init__(self) -> None:
        self.seen: list[str | None] = []

    def structured_checked(self, reason: str | None) -> None:
        self.seen.append(reason)


def _out(index: int, text: str, finish: str | None = None, stop: int | str | None = None) -> Output:
    return Output(index, text, [], 1, finish_reason=finish, stop_reason=stop)


@pytest.mark.anyio
async def test_output_check_counts_finished_answers_only() -> None:
    found = await structured_outputs(chat(guided_json=UNIQUE), CAPS)
    metrics = _Metrics()
    check = relaxed_check(metrics, found, {})
    assert isinstance(check, OutputCheck)
    check.take([_out(0, '{"tags":'), _out(1, '{"tags":["a"'), _out(2, "{"), _out(3, '{"tags":["a"]}', "stop", ",")])
    check.take([_out(0, '["x","x"]}', "stop", 151645), _out(1, ',"b"]}', "stop"), _out(2, "", "length")])
    await check.finish()
    # 0: duplicates (relaxed uniqueItems); 1: valid; 2: cut by max_tokens and 3: by a stop string: not checked
    assert sorted(metrics.seen, key=str) == [None, "uniqueItems"]


@pytest.mark.anyio
async def test_output_check_of_tool_calls_checks_relaxed_functions_arguments() -> None:
    from server.structured.parsing import ChoiceParsers
    from server.tools.choice import plan_tools

    tools = [_tool("f", UNIQUE), _tool("g", {"type": "object"})]
    plan = plan_tools(tools, "required", parser_name="hermes", enable_auto=True, token_id=lambda t: None)
    _, relaxed = await relax_tools(tools, CAPS)
    metrics = _Metrics()
    check = OutputCheck(metrics, ChoiceParsers(plan, None, "prompt"), tools=relaxed)
    text = (
        '<tool_call>\n{"name": "f", "arguments": {"tags": ["x", "x"]}}\n</tool_call>'
        '<tool_call>\n{"name": "g", "arguments": {"z": 1}}\n</tool_call>'
    )
    check.take([_out(0, text, "stop")])
    await check.finish()
    assert metrics.seen == ["uniqueItems"]  # g is enforced whole: not checked
