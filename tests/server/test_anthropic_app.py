"""/v1/messages over real HTTP with the FakeEngineClient: the exact event sequence, pings, errors mid-stream and
before it, body limits and auth, all in Anthropic's shapes."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterable, Iterator
from typing import Any

import httpx
import pytest
from test_app import GEN, TEXT, TOK, Running, serve_in_thread

HI = {"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}]}


@pytest.fixture(scope="module")
def srv() -> Iterator[Running]:
    yield from serve_in_thread(direct=True)


def sse_events(lines: Iterable[str]) -> list[tuple[str, Any]]:
    """(event, data) pairs; every data line follows its event line, as Anthropic frames them."""
    out: list[tuple[str, Any]] = []
    kind = None
    for line in lines:
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: "):
            assert kind is not None, line
            out.append((kind, json.loads(line[6:])))
            kind = None
    return out


def test_message_and_its_stream(srv: Running) -> None:
    r = httpx.post(srv.url + "/v1/messages", json=HI, headers={"X-Request-Id": "abc"})
    assert r.status_code == 200 and r.headers["request-id"] == "abc"
    prompt = len(
        TOK.encode(
            "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
            "assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        ).ids
    )
    assert r.json() == {
        "type": "message",
        "id": "msg_abc",
        "role": "assistant",
        "model": "tiny",
        "content": [{"type": "text", "text": TOK.decode(GEN[:5])}],
        "stop_reason": "max_tokens",
        "stop_sequence": None,
        "usage": {"input_tokens": prompt, "output_tokens": 5},
    }
    count = httpx.post(srv.url + "/v1/messages/count_tokens", json={"model": "tiny", "messages": HI["messages"]})
    assert count.json() == {"input_tokens": prompt}

    with httpx.stream("POST", srv.url + "/v1/messages", json={**HI, "max_tokens": len(GEN), "stream": True}) as s:
        assert s.headers["content-type"].startswith("text/event-stream")
        raw = s.read()
        events = sse_events(s.iter_lines())
    assert b"[DONE]" not in raw
    kinds = [k for k, _ in events]
    assert kinds[:3] == ["message_start", "content_block_start", "ping"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    assert all(k == d["type"] for k, d in events)
    assert "".join(d["delta"]["text"] for k, d in events if k == "content_block_delta") == TEXT
    assert events[-2][1]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert events[-2][1]["usage"]["output_tokens"] == len(GEN)


def test_stop_sequence(srv: Running) -> None:
    stop = TEXT[10:14]
    body = {**HI, "max_tokens": len(GEN), "stop_sequences": [stop]}
    msg = httpx.post(srv.url + "/v1/messages", json=body).json()
    assert msg["content"][0]["text"] == TEXT[:10]
    assert (msg["stop_reason"], msg["stop_sequence"]) == ("stop_sequence", stop)
    with httpx.stream("POST", srv.url + "/v1/messages", json={**body, "stream": True}) as s:
        events = sse_events(s.iter_lines())
    assert "".join(d["delta"]["text"] for k, d in events if k == "content_block_delta") == TEXT[:10]
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": stop}


def test_errors_before_the_response_are_anthropic_shaped(srv: Running) -> None:
    def error(r: httpx.Response, status: int, kind: str) -> str:
        assert r.status_code == status, r.text
        body = r.json()
        assert body["type"] == "error" and body["error"]["type"] == kind and set(body) == {"type", "error"}
        return str(body["error"]["message"])

    url = srv.url + "/v1/messages"
    assert "max_tokens" in error(httpx.post(url, json={**HI, "max_tokens": 0}), 400, "invalid_request_error")
    assert "max_tokens" in error(httpx.post(url, json={"messages": HI["messages"]}), 400, "invalid_request_error")
    assert "`other`" in error(httpx.post(url, json={**HI, "model": "other"}), 404, "not_found_error")
    assert "not valid JSON" in error(httpx.post(url, content=b"{"), 400, "invalid_request_error")
    error(httpx.post(url, content=b"x", headers={"content-type": "text/plain"}), 415, "invalid_request_error")
    huge = {**HI, "messages": [{"role": "user", "content": "x" * (33 << 20)}]}
    error(httpx.post(url, json=huge), 413, "request_too_large")
    images = {**HI, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}
    assert "images are not supported yet" in error(httpx.post(url, json=images), 400, "invalid_request_error")
    forced = {**HI, "tool_choice": {"type": "any"}}  # forced tool use with no tools
    assert "`tools` must be set" in error(httpx.post(url, json=forced), 400, "invalid_request_error")
    long = {**HI, "max_tokens": 600}
    assert "maximum context length" in error(httpx.post(url, json=long), 400, "invalid_request_error")


def test_pings_while_queued_then_an_engine_death_mid_stream_is_an_error_event() -> None:
    gen = serve_in_thread(gate=True, sse_keepalive=0.05)
    running = next(gen)
    try:
        with httpx.stream("POST", running.url + "/v1/messages", json={**HI, "stream": True}, timeout=10) as r:
            lines = r.iter_lines()
            kinds = (line for line in lines if line.startswith("event: "))
            assert [next(kinds) for _ in range(4)] == [
                "event: message_start",
                "event: content_block_start",
                "event: ping",
                "event: ping",
            ]  # no token yet: pings
            running.portal.call(running.fake.allow_step, 1)
            delta = next(line for line in kinds if line != "event: ping")
            assert delta == "event: content_block_delta"
            running.portal.call(running.fake.die, "pipe closed")
            events = sse_events(itertools.chain([delta], lines))
        assert events[-1][0] == "error" and events[-1][1]["error"]["type"] == "api_error"
        assert "pipe closed" in events[-1][1]["error"]["message"]
        deadline = time.monotonic() + 5
        while not running.deaths and time.monotonic() < deadline:
            time.sleep(0.02)
        r2 = httpx.post(running.url + "/v1/messages", json=HI)
        assert r2.status_code == 503 and r2.json()["error"]["type"] == "overloaded_error"
    finally:
        gen.close()


def test_x_api_key_and_anthropic_shaped_401s() -> None:
    gen = serve_in_thread(api_keys=("sekret",))
    running = next(gen)
    try:
        url = running.url + "/v1/messages"
        assert httpx.post(url, json=HI, headers={"x-api-key": "sekret"}).status_code == 200
        assert httpx.post(url, json=HI, headers={"Authorization": "Bearer sekret"}).status_code == 200
        version = {"anthropic-version": "2023-06-01"}  # Anthropic's API requires it: its clients always send it
        for headers in (version, {"x-api-key": "wrong"}, {"Authorization": "Bearer wrong", **version}):
            r = httpx.post(url, json=HI, headers=headers)
            assert r.status_code == 401 and r.json() == {
                "type": "error",
                "error": {"type": "authentication_error", "message": r.json()["error"]["message"]},
            }
        r = httpx.post(running.url + "/v1/completions", json={"prompt": "Hi"})
        assert r.status_code == 401 and r.json()["error"]["code"] == 401  # OpenAI's shape for OpenAI's clients
        models = httpx.get(running.url + "/v1/models", headers={"x-api-key": "sekret"})
        assert models.status_code == 200
    finally:
        gen.close()
