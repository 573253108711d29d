"""Structured output with --speculative-config ngram through the real server: json_schema and tool_choice
"required", streamed and not, give the same greedy answers as a server without speculation, and the constrained
requests themselves verify drafts (the spec_decode counters move)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import Server, start_server
from tests.e2e.test_speculative import SPEC, TEXT

# a long free-form string (the demo model would close a short one at once): its repetitive text inside is what
# the drafts hit; finished near max_tokens
NOTE = {"type": "string", "minLength": 20}
SCHEMA = {
    "type": "object",
    "properties": {"note": NOTE, "count": {"type": "integer"}},
    "required": ["note", "count"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "echo",
            "parameters": {"type": "object", "properties": {"text": NOTE}, "required": ["text"]},
        },
    }
]
MSGS = [{"role": "user", "content": TEXT}]
BODIES: list[dict[str, Any]] = [
    {"messages": MSGS, "max_tokens": 80, "temperature": 0, "response_format": FORMAT},
    {"messages": MSGS, "max_tokens": 80, "temperature": 0, "tools": TOOLS, "tool_choice": "required"},
]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server]]:
    from demo.checkpoints import demo_checkpoint_path  # the demo's greedy output repeats itself: drafts land

    model = demo_checkpoint_path()
    tmp = tmp_path_factory.mktemp("spec-structured")
    plain = start_server(model, tmp)
    spec = start_server(model, tmp, "--speculative-config", SPEC)
    yield plain, spec
    plain.stop()
    spec.stop()


def answer(server: Server, body: dict[str, Any]) -> tuple[Any, ...]:
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "tiny", **body}, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    msg = choice["message"]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls") or []]
    return msg.get("content"), calls, choice["finish_reason"], r.json()["usage"]["completion_tokens"]


def streamed(server: Server, body: dict[str, Any]) -> tuple[str, str, str | None]:
    """The streamed content, the concatenated tool-call argument deltas and the finish reason."""
    content, args, reason = "", "", None
    with httpx.stream(
        "POST", f"{server.url}/v1/chat/completions", json={"model": "tiny", "stream": True, **body}, timeout=120
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:])["choices"]:
                content += c["delta"].get("content") or ""
                args += "".join(
                    (t.get("function") or {}).get("arguments") or "" for t in c["delta"].get("tool_calls") or []
                )
                reason = c.get("finish_reason") or reason
    return content, args, reason


@pytest.mark.parametrize("kind", ["json_schema", "tool_choice required"])
def test_constrained_answers_identical_with_drafts(servers: tuple[Server, Server], kind: str) -> None:
    plain, spec = servers
    body = BODIES[0] if kind == "json_schema" else BODIES[1]
    drafts = spec.metric("spindle_spec_decode_num_drafts_total")
    want = answer(plain, body)
    assert answer(spec, body) == want
    # constrained rows verified (how many the adaptive length drafts depends on the step costs it measures)
    assert spec.metric("spindle_spec_decode_num_drafts_total") > drafts
    if kind == "json_schema":
        assert want[2] == "stop" and set(json.loads(want[0])) == {"note", "count"}
    else:
        assert want[1] and want[1][0][0] == "echo" and "text" in json.loads(want[1][0][1])
    assert streamed(spec, body) == streamed(plain, body)
