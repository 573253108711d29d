"""--speculative-config ngram through the real server: greedy answers identical to a server without it, streamed or
not, chat and completions, n > 1, stop strings, logprobs, max_tokens; the spec_decode counters move."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import Server, start_server

SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 2}'
TEXT = "one two three four five six seven eight nine ten one two three four five six seven eight nine ten"


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server]]:
    from demo.checkpoints import demo_checkpoint_path  # the demo's greedy output repeats itself: drafts land

    model: Path = demo_checkpoint_path()
    tmp = tmp_path_factory.mktemp("spec")
    plain = start_server(model, tmp)
    spec = start_server(model, tmp, "--speculative-config", SPEC)
    yield plain, spec
    plain.stop()
    spec.stop()


def post(server: Server, path: str, body: dict[str, object]) -> dict[str, object]:
    r = httpx.post(f"{server.url}{path}", json={"model": "tiny", **body}, timeout=120)
    assert r.status_code == 200, r.text
    return dict(r.json())


def streamed(server: Server, body: dict[str, object]) -> str:
    text = ""
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json={"model": "tiny", "stream": True, **body}, timeout=120
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
    return text


BODIES = [
    ("/v1/completions", {"prompt": TEXT, "max_tokens": 40, "temperature": 0}),
    ("/v1/completions", {"prompt": TEXT, "max_tokens": 17, "temperature": 0, "n": 2, "logprobs": 2}),
    ("/v1/completions", {"prompt": "seven eight nine " + TEXT, "max_tokens": 40, "temperature": 0, "stop": ["five"]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": TEXT}], "max_tokens": 30, "temperature": 0}),
]


def close(a: object, b: object) -> bool:
    """Equal, floats within 1e-3: a verification's rows run as a chunk, a decode's alone (float sums differ)."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-3
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
    return a == b


def answers(body: dict[str, object]) -> list[object]:
    choices = body["choices"]
    assert isinstance(choices, list)
    return [(c.get("text", c.get("message")), c["finish_reason"], c.get("logprobs")) for c in choices]


def test_same_answers_with_and_without(servers: tuple[Server, Server]) -> None:
    plain, spec = servers
    for path, body in BODIES:
        assert close(answers(post(spec, path, body)), answers(post(plain, path, body))), (path, body)
        usage = post(spec, path, body)["usage"]
        assert usage == post(plain, path, body)["usage"]
    body = {"prompt": TEXT, "max_tokens": 40, "temperature": 0}
    assert streamed(spec, body) == streamed(plain, body)
    assert spec.metric("spindle_spec_decode_num_accepted_tokens_total") > 0
    assert spec.metric("spindle_spec_decode_num_drafts_total") > 0


def streamed_usage(server: Server, path: str, body: dict[str, object]) -> tuple[str, object, object]:
    """A stream's text, its last finish_reason and its usage chunk (stream_options.include_usage)."""
    text, finish, usage = "", None, None
    full = {"model": "tiny", "stream": True, "stream_options": {"include_usage": True}, **body}
    with httpx.stream("POST", f"{server.url}{path}", json=full, timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for c in chunk["choices"]:
                text += c.get("text") or (c.get("delta") or {}).get("content") or ""
                finish = c.get("finish_reason") or finish
    return text, finish, usage


def test_a_stop_string_inside_an_accepted_draft_ends_the_run_there(servers: tuple[Server, Server]) -> None:
    """Stop strings that end at several places of the plain answer (its prefixes: each ends where it is cut),
    most of them inside a step of several accepted tokens: the same text, usage, logprobs and finish with
    speculation, streamed or not, chat and completions, n > 1."""
    plain, spec = servers
    chat = {"messages": [{"role": "user", "content": TEXT}], "max_tokens": 30, "temperature": 0}
    shapes = [
        ("/v1/completions", {"prompt": TEXT, "max_tokens": 40, "temperature": 0, "logprobs": 2}),
        ("/v1/completions", {"prompt": TEXT, "max_tokens": 40, "temperature": 0, "n": 2}),
        ("/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 2}),
    ]
    stopped_early = 0
    for path, body in shapes:
        choice = post(plain, path, body)["choices"][0]  # type: ignore[index]
        text = str(choice.get("text") or choice["message"]["content"])
        for cut in range(len(text) // 4, len(text), max(len(text) // 5, 1)):
            stopped = {**body, "stop": [text[:cut]]}
            want, got = post(plain, path, stopped), post(spec, path, stopped)
            assert close(answers(got), answers(want)), (path, cut)
            assert got["usage"] == want["usage"], (path, cut)
            assert streamed_usage(spec, path, stopped) == streamed_usage(plain, path, stopped), (path, cut)
            stopped_early += want["choices"][0]["finish_reason"] == "stop"  # type: ignore[index]
    assert stopped_early >= 6
