"""Structured output through the official openai SDK against the real server and engine (one server for the module).

The tiny random model follows no instruction, so everything it emits under a constraint comes from the constraint:
finished outputs must match it exactly (finish_reason "stop"), cut ones (max_tokens, a stop string) must be a
prefix of something that does. Free-form schemas (unbounded strings and numbers) are finished by the engine
just inside max_tokens, so they end with "stop" too.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.e2e.conftest import Server, start_server

CAP = 2048  # --max-structured-output-size for this module's server
MSGS: Any = [{"role": "user", "content": "Answer in JSON."}]
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]}},
    "required": ["ok", "color"],
    "additionalProperties": False,
}
RESPONSE_FORMAT: Any = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
# every output SCHEMA allows (compact JSON: the backend allows no free whitespace), keys in either order
COMPLETE = {
    json.dumps(dict(items), separators=(",", ":"))
    for ok, color in itertools.product([True, False], ["red", "green"])
    for items in itertools.permutations([("ok", ok), ("color", color)])
}
CHOICES = ["red", "green", "blue"]


@pytest.fixture(scope="module")
def srv(qwen2_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(
        qwen2_ckpt,
        tmp_path_factory.mktemp("structured"),
        "--max-structured-output-size",
        str(CAP),
        env={"SPINDLE_STRUCTURED_OUTPUTS_WARMUP": "1", "SPINDLE_LOG_LEVEL": "INFO"},
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=60)


def check_schema(text: str) -> None:
    """A finished output: valid JSON that satisfies SCHEMA (with jsonschema when installed, else by hand)."""
    value = json.loads(text)
    try:
        import jsonschema
    except ImportError:
        assert set(value) == {"ok", "color"} and isinstance(value["ok"], bool) and value["color"] in ("red", "green")
    else:
        jsonschema.validate(value, SCHEMA)
    assert text in COMPLETE


def check_prefix(text: str) -> None:
    assert any(full.startswith(text) for full in COMPLETE), text


# ------------------------------------------------------------------------- enforcement (needs the engine)


def test_json_schema_chat(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=40, temperature=1.0, n=2, seed=3, response_format=RESPONSE_FORMAT
    )
    assert len(out.choices) == 2
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        check_schema(choice.message.content or "")
    again = client.chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=40, temperature=1.0, n=2, seed=3, response_format=RESPONSE_FORMAT
    )
    assert [c.message.content for c in again.choices] == [c.message.content for c in out.choices]  # seeded


def test_json_schema_streamed(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=MSGS, max_tokens=40, stream=True, response_format=RESPONSE_FORMAT
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    check_schema(text)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


def test_json_schema_completions_and_the_sdk_parse_helper(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model="tiny", prompt="JSON:", max_tokens=40, extra_body={"structured_outputs": {"json": SCHEMA}}
    )
    assert out.choices[0].finish_reason == "stop"
    check_schema(out.choices[0].text)
    from typing import Literal

    import pydantic

    class Answer(pydantic.BaseModel):
        ok: bool
        color: Literal["red", "green"]

    parsed = client.chat.completions.parse(model="tiny", messages=MSGS, max_tokens=40, response_format=Answer)
    answer = parsed.choices[0].message.parsed
    assert isinstance(answer, Answer) and parsed.choices[0].finish_reason == "stop"


def test_a_cut_output_is_a_valid_prefix(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=3, response_format=RESPONSE_FORMAT)
    assert out.choices[0].finish_reason == "length"
    check_prefix(out.choices[0].message.content or "")
    out = client.chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=40, stop=[","], response_format=RESPONSE_FORMAT
    )
    assert out.choices[0].finish_reason == "stop"
    text = out.choices[0].message.content or ""
    assert "," not in text and text not in COMPLETE
    check_prefix(text)


def test_json_object(client: openai.OpenAI) -> None:
    for stream in (False, True):
        if stream:
            chunks = list(
                client.chat.completions.create(
                    model="tiny", messages=MSGS, max_tokens=24, stream=True, response_format={"type": "json_object"}
                )
            )
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
        else:
            out = client.chat.completions.create(
                model="tiny", messages=MSGS, max_tokens=24, response_format={"type": "json_object"}
            )
            text, finish = out.choices[0].message.content or "", out.choices[0].finish_reason
        assert finish == "stop", text  # any object, finished near max_tokens at the latest
        assert isinstance(json.loads(text), dict)


def test_the_grammar_backend_is_built_before_the_engine_is_ready(srv: Server) -> None:
    """SPINDLE_STRUCTURED_OUTPUTS_WARMUP (on by default): not at the first constrained request."""
    log = srv.log.read_text()
    assert "grammar backend ready" in log, log[-2000:]
    assert log.index("grammar backend ready") < log.index("engine ready")


FREE = {
    "type": "object",
    "required": ["name", "age", "notes"],
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "notes": {"type": "array", "items": {"type": "string"}},
    },
}


@pytest.mark.parametrize("max_tokens", [60, 120])
def test_free_form_schema_ends_with_stop_streamed_and_not(client: openai.OpenAI, max_tokens: int) -> None:
    """No maxLength, no range: the random model never closes a string itself; the output still validates."""
    import jsonschema

    fmt: Any = {"type": "json_schema", "json_schema": {"name": "person", "schema": FREE}}
    out = client.chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=max_tokens, temperature=1.0, n=3, seed=11, response_format=fmt
    )
    assert out.usage is not None and out.usage.completion_tokens <= 3 * max_tokens
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content or ""), FREE)
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=MSGS, max_tokens=max_tokens, temperature=0.0, stream=True, response_format=fmt
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["stop"]
    jsonschema.validate(json.loads(text), FREE)
    whole = client.chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=max_tokens, temperature=0.0, response_format=fmt
    )
    assert whole.choices[0].message.content == text and whole.choices[0].finish_reason == "stop"
    regex = client.completions.create(
        model="tiny",
        prompt="Mail:",
        max_tokens=max_tokens,
        n=2,
        seed=5,
        extra_body={"structured_outputs": {"regex": r"[a-z]+@[a-z]+\.com"}},
    )
    for c in regex.choices:
        assert c.finish_reason == "stop" and re.fullmatch(r"[a-z]+@[a-z]+\.com", c.text), c.text


def test_whitespace_pattern_allows_that_whitespace_and_still_finishes(client: openai.OpenAI) -> None:
    import jsonschema

    out = client.chat.completions.create(
        model="tiny",
        messages=MSGS,
        max_tokens=80,
        temperature=1.0,
        n=2,
        seed=4,
        extra_body={"structured_outputs": {"json": FREE, "whitespace_pattern": "[ \n]{0,2}"}},
    )
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        text = choice.message.content or ""
        jsonschema.validate(json.loads(text), FREE)
        assert not re.search(r"[ \n]{3}", re.sub(r'"(\\.|[^"\\])*"', '""', text))  # outside strings: <= 2


def test_choice(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model="tiny", prompt="Pick:", max_tokens=10, n=2, seed=1, extra_body={"structured_outputs": {"choice": CHOICES}}
    )
    assert all(c.text in CHOICES and c.finish_reason == "stop" for c in out.choices)
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=MSGS, max_tokens=10, stream=True, extra_body={"guided_choice": CHOICES}
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) in CHOICES


def test_regex(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model="tiny", prompt="Code:", max_tokens=10, extra_body={"structured_outputs": {"regex": "[ab]{3}-[0-9]"}}
    )
    assert out.choices[0].finish_reason == "stop" and re.fullmatch("[ab]{3}-[0-9]", out.choices[0].text)
    cut = client.completions.create(
        model="tiny", prompt="Code:", max_tokens=1, extra_body={"structured_outputs": {"regex": "[ab]{3}-[0-9]"}}
    )
    assert re.fullmatch(r"[ab]{0,3}(-[0-9]?)?", cut.choices[0].text), cut.choices[0].text


# ------------------------------------------------------------------------ 400s (the server alone decides)


@pytest.mark.parametrize(
    ("kwargs", "param", "needle"),
    [
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
            "format",
        ),  # strict: refused (without it: relaxed, an annotation)
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
            "schema",
        ),
        ({"extra_body": {"structured_outputs": {"json": "{not json"}}}, "structured_outputs.json", "not valid JSON"),
        ({"extra_body": {"structured_outputs": {"regex": "a(b"}}}, "structured_outputs.regex", "unclosed group"),
        ({"extra_body": {"structured_outputs": {"choice": []}}}, "structured_outputs.choice", "non-empty"),
        (
            {"extra_body": {"structured_outputs": {"grammar": "start: nowhere"}}},
            "structured_outputs.grammar",
            "nowhere",
        ),
        (
            {"extra_body": {"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}},
            "structured_outputs.whitespace_pattern",
            "whitespace_pattern",
        ),
        (
            {"response_format": {"type": "json_object"}, "extra_body": {"structured_outputs": {"regex": "a"}}},
            "structured_outputs.regex",
            "response_format and structured_outputs.regex",
        ),
        (
            {"extra_body": {"structured_outputs": {"regex": "a" * (CAP + 1)}}},
            "structured_outputs.regex",
            "--max-structured-output-size",
        ),
        ({"extra_body": {"structured_outputs": {"choice": "yes"}}}, "structured_outputs.choice", "Expected `array"),
    ],
)
def test_400s_through_the_sdk(client: openai.OpenAI, kwargs: dict[str, Any], param: str, needle: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=4, **kwargs)
    err = e.value.body
    assert isinstance(err, dict) and err["param"] == param and needle in err["message"], err
    assert e.value.status_code == 400


def test_size_cap_at_and_just_under_is_accepted(srv: Server, client: openai.OpenAI) -> None:
    """Accepted by the server (the 400 check); what the engine then generates is not looked at here."""
    for size in (CAP - 1, CAP):
        out = client.completions.create(
            model="tiny", prompt="x", max_tokens=1, extra_body={"structured_outputs": {"regex": "a" * size}}
        )
        assert len(out.choices) == 1
