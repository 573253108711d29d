"""The app over real HTTP (Hypercorn on Trio, in a thread) with the real renderer and the FakeEngineClient."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
import openai
import pytest
from fake_engine import FakeEngineClient, fake_engine_factory
from hypercorn.config import Config

from demo.tokenizers import load_tokenizer, tokenizer_dir
from engine.messages import AddRequest
from server.app import create_app
from server.config import ServerConfig
from server.http import direct_body
from tests.helpers.processes import wait_until

TOK = load_tokenizer("qwen2")
TEXT = "Hello there, how are you doing today? I am fine, thanks. 🦊"
GEN = TOK.encode(TEXT).ids


def script(req: AddRequest) -> list[int]:
    return GEN * 40 if req.params.ignore_eos else GEN  # ignore_eos: a long stream for disconnect tests


@dataclass
class Running:
    url: str
    fake: FakeEngineClient
    deaths: list[str]
    portal: Any  # runs calls in the server's event loop thread

    def sse(self, path: str, body: dict[str, Any], **kw: Any) -> list[Any]:
        with httpx.stream("POST", self.url + path, json=body, timeout=30, **kw) as r:
            assert r.status_code == 200, r.read()
            assert r.headers["content-type"].startswith("text/event-stream")
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        return [json.loads(e) for e in events[:-1]]


def serve_in_thread(gate: bool = False, direct: bool = False, **config: Any) -> Iterator[Running]:
    """Hypercorn (trio worker) serving create_app(...) in a portal thread; shut down on exit.
    direct: with server.http.direct_body installed, as `spindle serve` runs it (else plain Hypercorn)."""
    import hypercorn.trio
    from hypercorn.trio import run as hypercorn_trio_run

    fake = FakeEngineClient(script, max_model_len=512, gate=gate)
    deaths: list[str] = []
    config.setdefault("sse_keepalive", 0)
    cfg = ServerConfig.from_settings(model=str(tokenizer_dir("qwen2")), served_model_name="tiny", **config)
    app = create_app(cfg, engine_factory=fake_engine_factory(fake), on_fatal=deaths.append)
    hc = Config()
    hc.bind = ["127.0.0.1:0"]
    hc.accesslog = None
    hc.graceful_timeout = 1
    with anyio.from_thread.start_blocking_portal(backend="trio") as portal:
        stop = portal.call(anyio.Event)
        plain = hypercorn_trio_run.TCPServer
        writes = direct_body.WriteBatch()  # its writer task runs beside Hypercorn, as in `spindle serve`
        writer = portal.start_task_soon(writes.run) if direct else None
        try:
            assert not direct or direct_body.install("trio", writes)
            future, binds = portal.start_task(
                lambda task_status: hypercorn.trio.serve(app, hc, shutdown_trigger=stop.wait, task_status=task_status)
            )
        finally:
            hypercorn_trio_run.TCPServer = plain  # type: ignore[misc]  # the running server keeps its class
        try:
            yield Running(binds[0], fake, deaths, portal)
        finally:
            portal.call(stop.set)
            future.result(timeout=30)
            if writer is not None:
                portal.call(writes.stop)
                writer.result(timeout=30)


@pytest.fixture(scope="module")
def srv() -> Iterator[Running]:
    yield from serve_in_thread()


def test_completion_non_streaming(srv: Running) -> None:
    r = httpx.post(
        srv.url + "/v1/completions",
        json={"model": "tiny", "prompt": "Hi", "max_tokens": 5},
        headers={"X-Request-Id": "abc-1"},
    )
    assert r.status_code == 200 and r.headers["x-request-id"] == "abc-1"
    body = r.json()
    assert body["id"] == "cmpl-abc-1" and body["object"] == "text_completion" and body["model"] == "tiny"
    (choice,) = body["choices"]
    assert choice["text"] == TOK.decode(GEN[:5]) and choice["finish_reason"] == "length"
    assert body["usage"] == {
        "prompt_tokens": len(TOK.encode("Hi").ids),
        "completion_tokens": 5,
        "total_tokens": len(TOK.encode("Hi").ids) + 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    added = next(a for a in srv.fake.added if a.request_id.endswith("-abc-1"))
    assert re.fullmatch(r"[0-9a-f]+-abc-1", added.request_id)  # a counter keeps equal external ids apart


def test_chat_stream_shape(srv: Running) -> None:
    chunks = srv.sse(
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Hi"}],
            "stream": True,
            "n": 2,
            "stream_options": {"include_usage": True},
        },
    )
    assert all(c["object"] == "chat.completion.chunk" and c["id"].startswith("chatcmpl-") for c in chunks)
    texts: dict[int, str] = {0: "", 1: ""}
    seen_role: set[int] = set()
    finish: dict[int, Any] = {}
    for c in chunks[:-1]:
        for ch in c["choices"]:
            i = ch["index"]
            if i not in seen_role:
                assert ch["delta"].get("role") == "assistant"  # the first chunk of each choice
                seen_role.add(i)
            assert i not in finish  # nothing after the finishing chunk
            texts[i] += ch["delta"].get("content", "")
            if ch["finish_reason"] is not None:
                finish[i] = (ch["finish_reason"], ch["stop_reason"])
    assert texts == {0: TEXT, 1: TEXT} and finish == {0: ("length", None), 1: ("length", None)}
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 2 * len(GEN)


def test_openai_sdk_completion_stream_and_stop(srv: Running) -> None:
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
    stream = client.completions.create(
        model="tiny", prompt="Hi", stream=True, stop=["today"], extra_body={"include_stop_str_in_output": True}
    )
    parts, last = [], None
    for chunk in stream:
        parts.append(chunk.choices[0].text)
        last = chunk.choices[0]
    assert "".join(parts) == TEXT[: TEXT.index("today") + len("today")]
    assert last is not None and last.finish_reason == "stop"
    assert last.model_extra and last.model_extra["stop_reason"] == "today"
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_completion_tokens=3
    )
    assert chat.choices[0].message.content == TOK.decode(GEN[:3]) and chat.choices[0].finish_reason == "length"


def test_logprobs_shapes(srv: Running) -> None:
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert [c.token for c in content] == [TOK.decode([t]) for t in GEN[:4]]
    assert all(bytes(c.bytes) == c.token.encode() and len(c.top_logprobs) == 2 for c in content)  # type: ignore[arg-type]
    assert content[0].top_logprobs[1].token == TOK.decode([100]) and content[0].top_logprobs[1].logprob == -1.0
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "logprobs": 1})
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == [TOK.decode([t]) for t in GEN[:4]] and lp["token_logprobs"] == [-0.5] * 4
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(4)]
    assert lp["top_logprobs"][0] == {lp["tokens"][0]: -0.5}
    echo = httpx.post(
        srv.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "echo": True, "return_token_ids": True}
    ).json()
    assert echo["choices"][0]["text"] == "Hi" + TOK.decode(GEN[:2])
    assert echo["choices"][0]["token_ids"] == GEN[:2] and echo["choices"][0]["prompt_token_ids"] == TOK.encode("Hi").ids
    ids = srv.sse(
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True, "return_token_ids": True},
    )
    assert [t for c in ids[1:] for t in c["choices"][0]["token_ids"]] == GEN[:3]
    streamed = srv.sse("/v1/completions", {"prompt": "Hi", "max_tokens": 3, "logprobs": 0, "stream": True})
    tokens = [t for c in streamed for t in c["choices"][0]["logprobs"]["tokens"]]
    offsets = [o for c in streamed for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert tokens == [TOK.decode([t]) for t in GEN[:3]] and offsets == [0, len(tokens[0]), len(tokens[0] + tokens[1])]


def test_errors(srv: Running) -> None:
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "Hi", "model": "other"})
    assert r.status_code == 404 and "`other`" in r.json()["error"]["message"]
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": [1, 2, 10**6]})
    assert r.status_code == 400 and "out of vocabulary" in r.json()["error"]["message"]
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 512})
    assert r.status_code == 400 and "maximum context length is 512" in r.json()["error"]["message"]
    r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400
    r = httpx.get(srv.url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


def test_models_and_health(srv: Running) -> None:
    models = httpx.get(srv.url + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny"
    assert models["data"][0]["max_model_len"] == 512
    assert httpx.get(srv.url + "/health").status_code == 200
    assert "version" in httpx.get(srv.url + "/version").json()


def leave_mid_stream(running: Running) -> None:
    """Read one event of a long stream, hang up; return once the engine request is aborted (within 10 s)."""
    body = {"prompt": "Hi", "stream": True, "ignore_eos": True, "max_tokens": 400}
    with httpx.stream("POST", running.url + "/v1/completions", json=body, headers={"X-Request-Id": "gone"}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # leave after the first event
    wait_until(lambda: any(a.endswith("-gone") for a in running.fake.aborted), 10, "the request was aborted")


def aborts_once_stopped(gen: Iterator[Running], running: Running, ungate: bool = False) -> list[str]:
    """Every abort the server sent, counted once none can follow: a fresh request's answer needs a later engine
    step (steps are handled in order, each one's aborts sent before the next), then the server stops, which ends
    every request's task. ungate: let a gated engine step."""
    if ungate:
        running.portal.call(running.fake.allow_step, 100)
    r = httpx.post(running.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200, r.text
    gen.close()
    return [a.split("-", 1)[1] for a in running.fake.aborted]


def test_disconnect_mid_stream_aborts() -> None:
    gen = serve_in_thread()
    running = next(gen)
    try:
        leave_mid_stream(running)
        assert aborts_once_stopped(gen, running) == ["gone"]  # aborted, exactly once
    finally:
        gen.close()


@pytest.mark.parametrize("direct", [False, True])
def test_engine_death_then_503(direct: bool) -> None:
    gen = serve_in_thread(gate=True, direct=direct)
    running = next(gen)
    try:
        body = {"messages": [{"role": "user", "content": "Hi"}], "stream": True}
        with httpx.stream("POST", running.url + "/v1/chat/completions", json=body, timeout=10) as r:
            lines = r.iter_lines()
            assert json.loads(next(lines)[6:])["choices"][0]["delta"]["role"] == "assistant"
            running.portal.call(running.fake.allow_step, 1)
            assert next(line for line in lines if line.startswith("data: "))
            running.portal.call(running.fake.die, "pipe closed")
            rest = [line[6:] for line in lines if line.startswith("data: ")]
        assert rest[-1] == "[DONE]"  # the stream ends with an error event, then [DONE]: no hang
        assert "pipe closed" in json.loads(rest[-2])["error"]["message"]
        wait_until(lambda: bool(running.deaths), 5, "the app heard of the engine's death")
        assert httpx.get(running.url + "/health").status_code == 503
        r = httpx.post(running.url + "/v1/completions", json={"prompt": "Hi"})
        assert r.status_code == 503 and "pipe closed" in r.json()["error"]["message"]
    finally:
        gen.close()


def test_nonstream_disconnect_aborts() -> None:
    gen = serve_in_thread(gate=True)  # the engine makes no progress: the client gives up first
    running = next(gen)
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                running.url + "/v1/chat/completions",
                timeout=0.5,
                headers={"X-Request-Id": "impatient"},
                json={"messages": [{"role": "user", "content": "Hi"}]},
            )
        wait_until(lambda: bool(running.fake.aborted), 5, "the request was aborted")
        assert aborts_once_stopped(gen, running, ungate=True) == ["impatient"]  # aborted, exactly once
    finally:
        gen.close()


@pytest.mark.parametrize("direct", [False, True])
def test_keepalive_while_queued_and_continuous_usage(direct: bool) -> None:
    gen = serve_in_thread(gate=True, direct=direct, sse_keepalive=0.05)
    running = next(gen)
    try:
        body = {
            "prompt": "Hi",
            "max_tokens": 3,
            "stream": True,
            "return_token_ids": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        with httpx.stream("POST", running.url + "/v1/completions", json=body, timeout=10) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line) == ": keep-alive"  # no token yet: the stream stays warm
            running.portal.call(running.fake.allow_step, 3)
            events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        sent = 0
        for e in events[:-1]:  # every chunk's usage counts the tokens sent so far (merged chunks carry several)
            sent += len(e["choices"][0]["token_ids"])
            assert e["usage"]["completion_tokens"] == sent
        assert sent == 3 and events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3
    finally:
        gen.close()


def test_streams_go_direct_with_the_same_text_and_disconnects_still_abort(monkeypatch: pytest.MonkeyPatch) -> None:
    writes: list[bytes] = []
    send = direct_body.DirectBody.send

    def counted(self: direct_body.DirectBody, data: bytes) -> bool:
        sent = send(self, data)
        if sent:
            writes.append(data)
        return sent

    monkeypatch.setattr(direct_body.DirectBody, "send", counted)
    gen = serve_in_thread(direct=True)
    running = next(gen)
    try:
        chunks = running.sse(
            "/v1/completions",
            {"prompt": "Hi", "stream": True, "max_tokens": len(GEN), "stream_options": {"include_usage": True}},
        )
        assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == TEXT
        assert chunks[-2]["choices"][0]["finish_reason"] == "length" and chunks[-1]["usage"][
            "completion_tokens"
        ] == len(GEN)
        assert all(w.startswith(b"data: {") and w.endswith(b"\n\n") for w in writes)
        # This client keeps up, so every content chunk goes direct (SseResponder.deliver) but the last, since a
        # finished output always goes through the route with the usage chunk and [DONE], and perhaps the first,
        # when the engine's first token came before the route set its waiter (then it waits in the collector).
        content = chunks[:-1]
        direct = [json.loads(w[6:]) for w in writes]
        assert len(content) > 10 and len(direct) >= len(content) - 2, f"{len(direct)} of {len(content)} went direct"
        assert is_subsequence(direct, content)  # what went direct is what the client got, in order
        del writes[:]
        chat = running.sse("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "stream": True})
        assert chat[0]["choices"][0]["delta"]["role"] == "assistant"
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chat) == TEXT
        direct = [json.loads(w[6:]) for w in writes]  # the role chunk (stream_start) goes through ASGI
        assert len(chat) > 10 and len(direct) >= len(chat[1:]) - 2, f"{len(direct)} of {len(chat[1:])} went direct"
        assert is_subsequence(direct, chat[1:])
        leave_mid_stream(running)
        assert aborts_once_stopped(gen, running) == ["gone"]
    finally:
        gen.close()


def is_subsequence(part: list[Any], whole: list[Any]) -> bool:
    rest = iter(whole)
    return all(any(x == y for y in rest) for x in part)


def test_api_key_and_admission() -> None:
    gen = serve_in_thread(api_keys=("sekret",))
    running = next(gen)
    try:
        assert httpx.post(running.url + "/v1/completions", json={"prompt": "Hi"}).status_code == 401
        r = httpx.post(
            running.url + "/v1/completions",
            json={"prompt": "Hi", "max_tokens": 2},
            headers={"Authorization": "Bearer sekret"},
        )
        assert r.status_code == 200
        assert httpx.get(running.url + "/health").status_code == 200  # not behind the key
    finally:
        gen.close()


def test_plain_hypercorn_with_several_workers_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """`hypercorn -w 2 'server.app:create_app()'`: Hypercorn's worker function, whose `config` local is
    its Config, loads the app; here this test's frame plays that part."""
    monkeypatch.setenv("SPINDLE_MODEL", "demo")  # not the default model (it may not be installed)
    config = Config()
    config.workers = 2
    with pytest.raises(SystemExit, match="--api-server-count 2"):
        create_app()
    config.workers = 1
    assert create_app().state_holder is not None  # one worker: built (the engine starts in the lifespan)
