"""The request side of structured output: which field asks for which constraint, every 400, the size cap at,
just under and just over, and validation in a worker thread (a blocked compile never stalls another request)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import anyio
import anyio.to_thread
import msgspec
import pytest

from engine.messages import StructuredOutputs
from engine.structured import grammar
from server.config import RequestCaps
from server.http.errors import APIError
from server.request.input_processor import ModelLimits, build_spec
from server.request.openai_protocol import ChatCompletionRequest, CompletionRequest
from server.structured import constraint as structured
from server.structured.constraint import check_constraint, requested_constraint, structured_outputs

CAPS = RequestCaps()
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


def chat(**fields: Any) -> ChatCompletionRequest:
    return msgspec.json.decode(
        msgspec.json.encode({"messages": [{"role": "user", "content": "x"}], **fields}), type=ChatCompletionRequest
    )


def completion(**fields: Any) -> CompletionRequest:
    return msgspec.json.decode(msgspec.json.encode({"prompt": "x", **fields}), type=CompletionRequest)


@pytest.fixture(autouse=True)
def fresh_cache() -> Iterator[None]:
    structured.clear_cache()
    yield
    structured.clear_cache()


def refused(fn: Any, *args: Any, **kw: Any) -> APIError:
    with pytest.raises(APIError) as e:
        fn(*args, **kw)
    assert e.value.status == 400
    return e.value


async def refused_async(req: Any, caps: RequestCaps = CAPS, **kw: Any) -> APIError:
    with pytest.raises(APIError) as e:
        await structured_outputs(req, caps, **kw)
    assert e.value.status == 400
    return e.value


# ------------------------------------------------------------------------------- which field, which kind


@pytest.mark.parametrize(
    ("fields", "kind", "spec", "param"),
    [
        ({"response_format": {"type": "json_object"}}, "json_object", "", "response_format"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SCHEMA, "strict": True},
                }
            },
            "json",
            json.dumps(SCHEMA, separators=(",", ":")),
            "response_format.json_schema.schema",
        ),
        (
            {"structured_outputs": {"json": SCHEMA}},
            "json",
            json.dumps(SCHEMA, separators=(",", ":")),
            "structured_outputs.json",
        ),
        (
            {"structured_outputs": {"json": '{"type": "string"}'}},
            "json",
            '{"type": "string"}',
            "structured_outputs.json",
        ),
        ({"structured_outputs": {"regex": "[ab]+"}}, "regex", "[ab]+", "structured_outputs.regex"),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, "choice", '["yes","no"]', "structured_outputs.choice"),
        ({"structured_outputs": {"grammar": 'start: "a"'}}, "grammar", 'start: "a"', "structured_outputs.grammar"),
        ({"structured_outputs": {"json_object": True}}, "json_object", "", "structured_outputs.json_object"),
        ({"guided_json": SCHEMA}, "json", json.dumps(SCHEMA, separators=(",", ":")), "guided_json"),
        ({"guided_regex": "a+"}, "regex", "a+", "guided_regex"),
        ({"guided_choice": ["a"]}, "choice", '["a"]', "guided_choice"),
        ({"guided_grammar": 'root ::= "a"'}, "grammar", 'root ::= "a"', "guided_grammar"),
    ],
)
def test_each_field_becomes_its_constraint(fields: dict[str, Any], kind: str, spec: str, param: str) -> None:
    for req in (chat(**fields), completion(**fields)):  # vLLM takes all of them on both routes
        found = requested_constraint(req)
        assert found is not None
        assert (found.constraint, found.param) == (StructuredOutputs(kind, spec), param)
        assert found.constraint.reasoning_end is None  # the reasoning parser's to set


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"response_format": {"type": "text"}},
        {"structured_outputs": {"json_object": False}},
        {"structured_outputs": {"disable_any_whitespace": True, "disable_fallback": True}},
        {"guided_decoding_backend": "xgrammar"},
    ],
)
def test_no_constraint(fields: dict[str, Any]) -> None:
    assert requested_constraint(chat(**fields)) is None


@pytest.mark.anyio
async def test_no_constraint_needs_no_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(structured, "backend_validate", _must_not_run)
    assert await structured_outputs(chat(response_format={"type": "text"}), CAPS) is None


def _must_not_run(so: StructuredOutputs) -> str | None:
    raise AssertionError("compiled")


@pytest.mark.parametrize(
    ("fields", "first", "second"),
    [
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "response_format",
            "structured_outputs.regex",
        ),
        (
            {"structured_outputs": {"json": SCHEMA, "choice": ["a"]}},
            "structured_outputs.json",
            "structured_outputs.choice",
        ),
        ({"structured_outputs": {"regex": "a"}, "guided_regex": "b"}, "structured_outputs.regex", "guided_regex"),
        (
            {
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
                "guided_json": SCHEMA,
            },
            "response_format.json_schema.schema",
            "guided_json",
        ),
        (
            {"structured_outputs": {"grammar": "start: a", "json_object": True}},
            "structured_outputs.grammar",
            "structured_outputs.json_object",
        ),
    ],
)
def test_two_constraints_are_a_400_naming_both(fields: dict[str, Any], first: str, second: str) -> None:
    err = refused(requested_constraint, chat(**fields))
    assert first in err.message and second in err.message and err.param == second


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
        ),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"guided_choice": []}, "guided_choice"),
        ({"structured_outputs": {"regex": "a", "whitespace_pattern": " *"}}, "structured_outputs.whitespace_pattern"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
        ({"guided_regex": "a+", "guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
        (
            {"structured_outputs": {"whitespace_pattern": " "}},
            "structured_outputs.whitespace_pattern",
        ),  # nothing to apply to
        (
            {
                "guided_json": SCHEMA,
                "guided_whitespace_pattern": " ",
                "structured_outputs": {"whitespace_pattern": "\n"},
            },
            "structured_outputs.whitespace_pattern",
        ),  # two that differ
    ],
)
def test_missing_or_unsupported_parts_are_a_400(fields: dict[str, Any], param: str) -> None:
    err = refused(requested_constraint, chat(**fields))
    assert err.param == param and param.rsplit(".", 1)[-1] in err.message


def test_whitespace_pattern_goes_with_a_json_constraint() -> None:
    for fields in (
        {"guided_json": SCHEMA, "guided_whitespace_pattern": "[ ]?"},
        {"structured_outputs": {"json_object": True, "whitespace_pattern": "[ ]?"}},
        {"response_format": {"type": "json_object"}, "structured_outputs": {"whitespace_pattern": "[ ]?"}},
    ):
        found = requested_constraint(chat(**fields))
        assert found is not None and found.constraint.whitespace_pattern == "[ ]?", fields
        assert found.pattern_param is not None and found.pattern_param.endswith("whitespace_pattern")


def test_disable_additional_properties_closes_every_object_schema() -> None:
    nested = {
        "type": "object",
        "properties": {
            "a": {"type": "object", "properties": {"b": {"type": "string"}}},
            "c": {"type": "object", "additionalProperties": True},
        },
    }
    for value in (nested, json.dumps(nested)):
        found = requested_constraint(chat(structured_outputs={"json": value, "disable_additional_properties": True}))
        assert found is not None
        schema = json.loads(found.constraint.spec)
        assert schema["additionalProperties"] is False
        assert schema["properties"]["a"]["additionalProperties"] is False
        assert schema["properties"]["c"]["additionalProperties"] is True  # given: left alone
    err = refused(requested_constraint, chat(structured_outputs={"json": "{no", "disable_additional_properties": True}))
    assert err.param == "structured_outputs.json" and "not valid JSON" in err.message


def test_generate_prefix_names_the_nested_field() -> None:
    err = refused(
        requested_constraint, completion(structured_outputs={"regex": "a", "choice": ["b"]}), prefix="sampling_params."
    )
    assert err.param == "sampling_params.structured_outputs.choice"
    assert "sampling_params.structured_outputs.regex" in err.message


# ------------------------------------------------------------------------------------- the backend's 400s


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("fields", "param", "needle"),
    [
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "not valid JSON"),
        ({"structured_outputs": {"json": [1, 2]}}, None, None),  # wrong type: msgspec's 400 (see the protocol tests)
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
            "response_format.json_schema.schema",
            "strin",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "strict": True, "schema": {"type": "string", "format": "bogus"}},
                }
            },
            "response_format.json_schema.schema",
            "Unknown format: bogus",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "strict": True, "schema": {"$ref": "#/definitions/missing"}},
                }
            },
            "response_format.json_schema.schema",
            "missing",
        ),
        ({"guided_json": {"type": "integer", "minimum": 5, "maximum": 1}}, "guided_json", "minimum"),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex", "unclosed group"),
        ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs.grammar", "undefined_rule"),
        ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs.grammar", "invalid grammar"),
        ({"guided_json": SCHEMA, "guided_whitespace_pattern": "[ "}, "guided_whitespace_pattern", "unclosed"),
    ],
)
async def test_what_the_backend_cannot_enforce_is_a_400(
    fields: dict[str, Any], param: str | None, needle: str | None
) -> None:
    if param is None:
        with pytest.raises(msgspec.ValidationError):
            chat(**fields)
        return
    err = await refused_async(chat(**fields))
    assert err.param == param and needle in err.message and err.message.startswith(f"Invalid {param}: ")


@pytest.mark.anyio
@pytest.mark.parametrize(
    "fields",
    [
        {"response_format": {"type": "json_object"}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
        {"structured_outputs": {"json": {"type": "string", "format": "email"}}},
        {"structured_outputs": {"regex": "[0-9]{3}-[a-z]+"}},
        {"structured_outputs": {"choice": ["red", "green", "blue"]}},
        {"structured_outputs": {"grammar": 'start: "yes" | "no"'}},
        {"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}},  # GBNF
    ],
)
async def test_valid_constraints_pass_the_real_backend(fields: dict[str, Any]) -> None:
    found = await structured_outputs(chat(**fields), CAPS)
    assert found is not None and found.relaxed is None and grammar.validate(found.so) is None


@pytest.mark.anyio
async def test_a_backend_exception_is_a_400_not_a_500(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(so: StructuredOutputs) -> str | None:
        raise RuntimeError("backend exploded")

    monkeypatch.setattr(structured, "backend_validate", boom)
    err = await refused_async(chat(guided_regex="a"))
    assert err.param == "guided_regex" and "backend exploded" in err.message


# --------------------------------------------------------------------------------------------- size cap


@pytest.mark.anyio
@pytest.mark.parametrize("over", [-1, 0, 1])
async def test_spec_size_at_just_under_and_just_over_the_default_cap(
    over: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[int] = []

    def stand_in(so: StructuredOutputs) -> str | None:
        seen.append(len(so.spec))
        return None

    monkeypatch.setattr(structured, "backend_validate", stand_in)
    cap = CAPS.max_structured_output_size
    assert cap == 256 * 1024
    req = chat(structured_outputs={"regex": "a" * (cap + over)})
    if over <= 0:
        assert await structured_outputs(req, CAPS) is not None and seen == [cap + over]
    else:
        err = await refused_async(req)
        assert err.param == "structured_outputs.regex" and "--max-structured-output-size" in err.message
        assert f"{cap + 1} bytes" in err.message and str(cap) in err.message
        assert seen == []  # refused before anything compiled it


@pytest.mark.anyio
async def test_size_counts_utf8_bytes_of_the_spec_the_engine_gets() -> None:
    caps = RequestCaps(max_structured_output_size=10)
    assert await structured_outputs(chat(guided_choice=["ééé"]), caps) is not None  # ["ééé"]: 10 bytes
    err = await refused_async(chat(guided_choice=["éééé"]), caps)  # 12 bytes, 8 characters
    assert "12 bytes" in err.message and err.param == "guided_choice"
    schema = {"enum": ["abcdefghijklmnop"]}  # an object schema counts as its compact JSON text
    err = await refused_async(
        chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}), caps
    )
    assert f"{len(json.dumps(schema, separators=(',', ':')))} bytes" in err.message
    # a whitespace_pattern counts with its constraint: "{}" (2 bytes, the schema) + 8 at the cap, + 9 over it
    assert await structured_outputs(chat(guided_json={}, guided_whitespace_pattern="[ ]{0,3}"), caps) is not None
    err = await refused_async(chat(guided_json={}, guided_whitespace_pattern="[ ]{0,33}"), caps)
    assert "11 bytes" in err.message


# ----------------------------------------------------------------------------------- off the event loop


@pytest.mark.anyio
async def test_a_blocked_compile_does_not_stall_another_request(monkeypatch: pytest.MonkeyPatch) -> None:
    entered, release = threading.Event(), threading.Event()

    def stand_in(so: StructuredOutputs) -> str | None:
        if so.spec == "slow":
            entered.set()
            assert release.wait(30)
        return None

    monkeypatch.setattr(structured, "backend_validate", stand_in)
    slow_done = anyio.Event()

    async def slow() -> None:
        await structured_outputs(chat(guided_regex="slow"), CAPS)
        slow_done.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(slow)
        await anyio.to_thread.run_sync(entered.wait)  # the slow compile is running in its thread
        fast = await structured_outputs(chat(guided_regex="fast"), CAPS)  # a second request validates meanwhile
        assert fast is not None and fast.so == StructuredOutputs("regex", "fast") and not slow_done.is_set()
        release.set()
    assert slow_done.is_set()


@pytest.mark.anyio
async def test_compiles_are_bounded_and_a_cached_result_needs_no_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    release = threading.Event()

    def stand_in(so: StructuredOutputs) -> str | None:
        calls.append(so.spec)
        assert release.wait(30)
        return "no good" if so.spec == "bad" else None

    monkeypatch.setattr(structured, "backend_validate", stand_in)
    specs = [f"s{i}" for i in range(structured.MAX_CONCURRENT_COMPILES + 1)]
    async with anyio.create_task_group() as tg:
        for spec in specs:
            tg.start_soon(structured_outputs, chat(guided_regex=spec), CAPS)
        await anyio.wait_all_tasks_blocked()
        limiter = structured._compile_limiter()
        assert limiter.borrowed_tokens == structured.MAX_CONCURRENT_COMPILES
        assert limiter.statistics().tasks_waiting == 1  # the third waits for a thread
        release.set()
    assert sorted(calls) == specs
    # hits: answered from the cache, no thread and no second compile, errors included
    monkeypatch.setattr(anyio.to_thread, "run_sync", _no_thread)
    for spec in specs:
        assert await structured_outputs(chat(guided_regex=spec), CAPS) is not None
    monkeypatch.undo()
    monkeypatch.setattr(structured, "backend_validate", stand_in)
    err = await refused_async(chat(guided_regex="bad"))
    assert "no good" in err.message
    monkeypatch.setattr(anyio.to_thread, "run_sync", _no_thread)
    err = await refused_async(chat(structured_outputs={"regex": "bad"}))  # same constraint, other field
    assert "no good" in err.message and err.param == "structured_outputs.regex"
    assert calls.count("bad") == 1


async def _no_thread(*args: Any, **kw: Any) -> Any:
    raise AssertionError("a cache hit went to a thread")


@pytest.mark.anyio
async def test_check_constraint_for_constraints_built_elsewhere() -> None:
    """What tool calling uses for the tools' schemas: the same size cap and backend check, its own param."""
    await check_constraint(StructuredOutputs("json", json.dumps(SCHEMA)), "tools", CAPS)
    with pytest.raises(APIError) as e:
        await check_constraint(StructuredOutputs("json", '{"type": "nope"}'), "tools", CAPS)
    assert e.value.param == "tools" and "nope" in e.value.message
    with pytest.raises(APIError) as e:
        await check_constraint(
            StructuredOutputs("json", json.dumps(SCHEMA)), "tools", RequestCaps(max_structured_output_size=10)
        )
    assert "--max-structured-output-size" in e.value.message


# ---------------------------------------------------------------------------------- into SamplingParams


@pytest.mark.anyio
async def test_the_constraint_reaches_sampling_params_of_every_choice() -> None:
    limits = ModelLimits(max_model_len=100, vocab_size=1000)
    req = completion(n=2, seed=5, structured_outputs={"choice": ["a", "b"]})
    found = await structured_outputs(req, limits.caps)
    so = found.so if found is not None else None
    spec = build_spec(req, [1, 2, 3], limits, external_id="x", stream=False, structured_outputs=so)
    assert spec.params.structured_outputs == StructuredOutputs("choice", '["a","b"]')
    assert [spec.child_params(i).structured_outputs for i in range(2)] == [so, so]
    assert build_spec(req, [1], limits, external_id="x", stream=False).params.structured_outputs is None
