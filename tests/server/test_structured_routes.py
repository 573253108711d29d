"""Structured output through the routes (real HTTP, the FakeEngineClient): the constraint reaches the engine's
SamplingParams on chat, completions and /inference/v1/generate; a bad one is a 400 before the engine sees it."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from test_app import Running, serve_in_thread

from engine.messages import StructuredOutputs

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


@pytest.fixture(scope="module")
def srv() -> Iterator[Running]:
    yield from serve_in_thread(max_structured_output_size=1024)


def sent(srv: Running, xid: str) -> list[StructuredOutputs | None]:
    return [a.params.structured_outputs for a in srv.fake.added if a.request_id.split("-", 1)[1].startswith(xid)]


def test_each_route_sends_the_constraint(srv: Running) -> None:
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        n=2,
        response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA, "strict": True}},
        extra_headers={"X-Request-Id": "so-chat"},
    )
    assert (
        sent(srv, "so-chat")
        == [StructuredOutputs("json", '{"type":"object","properties":{"ok":{"type":"boolean"}},"required":["ok"]}')] * 2
    )
    client.completions.create(
        model="tiny",
        prompt=["a", "b"],
        max_tokens=2,
        extra_body={"structured_outputs": {"choice": ["x", "y"]}},
        extra_headers={"X-Request-Id": "so-cmpl"},
    )
    assert sent(srv, "so-cmpl") == [StructuredOutputs("choice", '["x","y"]')] * 2
    r = httpx.post(
        srv.url + "/inference/v1/generate",
        headers={"X-Request-Id": "so-gen"},
        json={"token_ids": [1, 2], "sampling_params": {"max_tokens": 2, "structured_outputs": {"regex": "[ab]+"}}},
    )
    assert r.status_code == 200, r.text
    assert sent(srv, "so-gen") == [StructuredOutputs("regex", "[ab]+")]
    client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        response_format={"type": "text"},
        extra_headers={"X-Request-Id": "so-text"},
    )
    assert sent(srv, "so-text") == [None]


def test_a_relaxed_schema_reaches_the_engine_lenient_and_the_response_says_what(srv: Running) -> None:
    """Without strict: the engine gets the schema with llguidance's lenient options; the answer carries the header."""
    schema = {"type": "array", "items": {"type": "string"}, "uniqueItems": True}
    r = httpx.post(
        srv.url + "/v1/chat/completions",
        headers={"X-Request-Id": "so-relaxed"},
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 2,
            "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}},
        },
    )
    assert r.status_code == 200, r.text
    assert r.headers["x-structured-output-relaxed"] == "uniqueItems"
    [so] = sent(srv, "so-relaxed")
    assert so is not None and json.loads(so.spec) == {**schema, "x-guidance": {"lenient": True, "coerce_one_of": True}}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "r", "strict": True, "schema": {"type": "string", "format": "bogus"}},
                },
            },
            "response_format.json_schema.schema",
        ),
        ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "a("}}, "structured_outputs.regex"),
        ("/v1/completions", {"prompt": "x", "guided_regex": "a" * 1025}, "guided_regex"),
        (
            "/v1/completions",
            {"prompt": "x", "response_format": {"type": "json_object"}, "guided_choice": ["a"]},
            "guided_choice",
        ),
        (
            "/inference/v1/generate",
            {"token_ids": [1], "sampling_params": {"structured_outputs": {"grammar": "start: x"}}},
            "sampling_params.structured_outputs.grammar",
        ),
    ],
)
def test_bad_constraints_are_400_before_the_engine(srv: Running, path: str, body: dict, param: str) -> None:  # type: ignore[type-arg]
    before = len(srv.fake.added)
    r = httpx.post(srv.url + path, json={"model": "tiny", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "BadRequestError"
    assert len(srv.fake.added) == before
