"""Ollama's API through the real server with the official `ollama` client, unmodified: each answer equals the same
request over the OpenAI API (greedy), streamed or not; the model routes; embeddings on a pooling server; and
fill-in-the-middle (/infill, `suffix` on /v1/completions and /api/generate) token for token."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import ollama
import openai
import pytest

from tests.e2e.conftest import Server, start_server

MSGS = [{"role": "user", "content": "Say something about the sea."}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            # in the key order the ollama client sends (its Tool model): the template prints the JSON as given
            "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}},
        },
    }
]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
GREEDY = {"temperature": 0, "num_predict": 12}


@pytest.fixture(scope="module")
def srv(qwen25_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Qwen2.5's tokenizer: FIM tokens and a tool-calling template."""
    s = start_server(
        qwen25_ckpt, tmp_path_factory.mktemp("ollama"), "--enable-auto-tool-choice", "--tool-call-parser", "hermes"
    )
    yield s
    s.stop()


def clients(server: Server) -> tuple[ollama.Client, openai.OpenAI]:
    return ollama.Client(host=server.url, timeout=60), openai.OpenAI(
        base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60
    )


def model_of(server: Server) -> str:
    return str(httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"])


def test_chat_equals_openai_streamed_or_not(srv: Server) -> None:
    ol, oa = clients(srv)
    model = model_of(srv)
    want = oa.chat.completions.create(model=model, messages=MSGS, max_tokens=12, temperature=0)  # type: ignore[arg-type]
    got = ol.chat(model=model, messages=MSGS, options=GREEDY, stream=False)
    assert got.message.content == want.choices[0].message.content
    assert got.done and got.done_reason == "length"
    assert want.usage is not None
    assert got.prompt_eval_count == want.usage.prompt_tokens and got.eval_count == want.usage.completion_tokens == 12
    assert got.total_duration is not None and got.eval_duration is not None and got.total_duration >= got.eval_duration
    chunks = list(ol.chat(model=model, messages=MSGS, options=GREEDY, stream=True))
    assert [c.done for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert "".join(c.message.content or "" for c in chunks) == got.message.content
    last = chunks[-1]
    assert last.done_reason == "length" and last.eval_count == 12 and last.prompt_eval_count == got.prompt_eval_count
    assert last.prompt_eval_duration is not None and last.prompt_eval_duration > 0


def test_stream_is_ndjson_and_defaults_to_streaming(srv: Server) -> None:
    body = {"model": model_of(srv), "messages": MSGS, "options": {"num_predict": 3, "mirostat": 2}}
    with httpx.stream("POST", f"{srv.url}/api/chat", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"] == "application/x-ndjson"
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert len(lines) >= 2 and lines[-1]["done"] is True and lines[-1]["eval_count"] == 3
    assert all(set(line) >= {"model", "created_at", "message", "done"} for line in lines)


def test_format_schema_equals_openai(srv: Server) -> None:
    ol, oa = clients(srv)
    model = model_of(srv)
    options = {"temperature": 0, "num_predict": 40}
    got = ol.chat(model=model, messages=MSGS, format=SCHEMA, options=options, stream=False)
    want = oa.chat.completions.create(
        model=model,
        messages=MSGS,  # type: ignore[arg-type]
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "format", "schema": SCHEMA}},
    )
    assert got.message.content == want.choices[0].message.content
    if got.done_reason == "stop":
        assert set(json.loads(got.message.content or "")) == {"name", "age"}


def test_tools_render_as_openai_and_calls_come_back_as_objects(srv: Server) -> None:
    ol, oa = clients(srv)
    model = model_of(srv)
    got = ol.chat(model=model, messages=MSGS, tools=TOOLS, options=GREEDY, stream=False)
    want = oa.chat.completions.create(model=model, messages=MSGS, tools=TOOLS, max_tokens=12, temperature=0)  # type: ignore[arg-type]
    assert want.usage is not None and got.prompt_eval_count == want.usage.prompt_tokens
    assert (got.message.content or "") == (want.choices[0].message.content or "")
    # a turn with a call and its result renders: the call's arguments as an object, the result named by tool_name
    history = [
        *MSGS,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}],
        },
        {"role": "tool", "content": "12 degrees", "tool_name": "get_weather"},
    ]
    again = ol.chat(model=model, messages=history, tools=TOOLS, options=GREEDY, stream=False)
    assert again.done and again.prompt_eval_count is not None and again.prompt_eval_count > got.prompt_eval_count


def test_generate_templated_raw_and_system(srv: Server) -> None:
    ol, oa = clients(srv)
    model = model_of(srv)
    got = ol.generate(model=model, prompt="The sea", system="Be brief.", options=GREEDY)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The sea"}]
    want = oa.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)  # type: ignore[arg-type]
    assert got.response == want.choices[0].message.content
    raw = ol.generate(model=model, prompt="The sea is", raw=True, options=GREEDY)
    plain = oa.completions.create(model=model, prompt="The sea is", max_tokens=12, temperature=0)
    assert raw.response == plain.choices[0].text and raw.done_reason == "length"
    streamed = list(ol.generate(model=model, prompt="The sea is", raw=True, options=GREEDY, stream=True))
    assert "".join(c.response for c in streamed) == raw.response and streamed[-1].done


def tokens(srv: Server, **body: object) -> list[int]:
    return list(httpx.post(f"{srv.url}/tokenize", json=body).json()["tokens"])


def test_generate_context_continues_the_conversation(srv: Server) -> None:
    """A templated /api/generate ends with `context`: its prompt's ids and its answer's; sent back, the next prompt
    continues it (the same tokens as /v1/completions with those ids before the new templated prompt)."""
    ol, oa = clients(srv)
    model = model_of(srv)
    first = ol.generate(model=model, prompt="The sea", options=GREEDY)
    turn = tokens(srv, messages=[{"role": "user", "content": "The sea"}], add_generation_prompt=True)
    assert first.context is not None and first.eval_count is not None
    context = list(first.context)
    assert context[: len(turn)] == turn and len(context) == len(turn) + first.eval_count
    detok = httpx.post(f"{srv.url}/detokenize", json={"tokens": context[len(turn) :]}).json()["prompt"]
    assert detok.startswith(first.response)  # the answer's ids (with its stop token, when it stopped)
    streamed = list(ol.generate(model=model, prompt="The sea", options=GREEDY, stream=True))
    assert streamed[-1].context == context and all(c.context is None for c in streamed[:-1])

    second = ol.generate(model=model, prompt="And the sky?", context=context, options=GREEDY)
    turn2 = tokens(srv, messages=[{"role": "user", "content": "And the sky?"}], add_generation_prompt=True)
    want = oa.completions.create(model=model, prompt=context + turn2, max_tokens=12, temperature=0)
    assert second.response == want.choices[0].text
    assert second.prompt_eval_count == len(context) + len(turn2)
    assert second.context is not None and list(second.context[: len(context)]) == context

    raw = ol.generate(model=model, prompt="The sea is", raw=True, options=GREEDY)
    assert raw.context is None  # as Ollama: raw mode gives no context, and takes none
    for body, word in (
        ({"raw": True, "context": context}, "raw"),
        ({"context": [-1]}, "context[0]"),
        ({"context": [1, 10**9]}, "context[1]"),
        ({"context": [1] * 5000}, "max_model_len"),
    ):
        r = httpx.post(f"{srv.url}/api/generate", json={"model": model, "prompt": "x", "stream": False, **body})
        assert r.status_code == 400 and set(r.json()) == {"error"} and word in r.json()["error"], r.text


def test_keep_alive_is_reported_by_ps(srv: Server) -> None:
    """A single model never unloads: /api/ps's expires_at says what the last request's keep_alive asked for."""
    ol, _ = clients(srv)
    model = model_of(srv)
    before = datetime.now(UTC)
    ol.generate(model=model, prompt="Hi", options={"num_predict": 1}, keep_alive="10m")
    expires = ol.ps().models[0].expires_at
    assert expires is not None and timedelta(minutes=9) < expires - before < timedelta(minutes=11)
    ol.chat(model=model, messages=MSGS, options={"num_predict": 1}, keep_alive=90)
    expires = ol.ps().models[0].expires_at
    assert expires is not None and timedelta(seconds=80) < expires - before < timedelta(seconds=100)
    ol.generate(model=model, prompt="Hi", options={"num_predict": 1}, keep_alive=-1)
    assert ol.ps().models[0].expires_at == datetime(2318, 8, 24, tzinfo=UTC)  # forever
    with pytest.raises(ollama.ResponseError) as e:
        ol.generate(model=model, prompt="Hi", keep_alive="soon")
    assert e.value.status_code == 400 and "keep_alive" in str(e.value)
    again = ol.generate(model=model, prompt="Hi", options={"num_predict": 1})
    assert again.load_duration == 0  # only the first request after the load reports it
    assert again.total_duration is not None and again.total_duration > 0


def test_model_routes(srv: Server) -> None:
    ol, _ = clients(srv)
    model = model_of(srv)
    listed = ol.list().models
    assert [m.model for m in listed] == [model] and listed[0].size and listed[0].size > 0
    shown = ol.show(model)
    assert shown.capabilities is not None and {"completion", "tools", "insert"} <= set(shown.capabilities)
    assert shown.template and "tools" in shown.template
    running = ol.ps().models
    assert [m.model for m in running] == [model]
    assert httpx.get(f"{srv.url}/api/version").json()["version"]
    head = httpx.head(f"{srv.url}/")
    assert head.status_code == 200 and head.content == b""
    assert httpx.get(f"{srv.url}/").status_code == 200  # GET / is still the chat page


def test_errors_in_ollamas_shape(srv: Server) -> None:
    ol, _ = clients(srv)
    with pytest.raises(ollama.ResponseError) as e:
        ol.chat(model="no-such-model", messages=MSGS, stream=False)
    assert e.value.status_code == 404
    r = httpx.post(f"{srv.url}/api/chat", json={"messages": MSGS, "options": {"num_ctx": 10**9}})
    assert r.status_code == 400 and set(r.json()) == {"error"} and "num_ctx" in r.json()["error"]
    r = httpx.post(f"{srv.url}/api/generate", json={"prompt": "x", "format": "yaml", "stream": False})
    assert r.status_code == 400 and "format" in r.json()["error"]
    r = httpx.post(f"{srv.url}/api/chat", content=b"{not json")
    assert r.status_code == 400 and isinstance(r.json()["error"], str)


def fim_ids(srv: Server, prefix: str, suffix: str, extra: list[tuple[str, str]] = ()) -> list[int]:  # type: ignore[assignment]
    """The prompt llama.cpp's format_infill builds for Qwen2.5's vocabulary, from the tokenizer's own ids."""

    def tok(text: str) -> list[int]:
        r = httpx.post(f"{srv.url}/tokenize", json={"prompt": text, "add_special_tokens": False})
        return list(r.json()["tokens"]) if text else []

    special = {
        t: tok(t)[0] for t in ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|repo_name|>", "<|file_sep|>")
    }
    ids = [special["<|repo_name|>"], *tok("myproject\n")]
    for name, text in extra:
        ids += [special["<|file_sep|>"], *tok(name + "\n"), *tok(text)]
    ids += [special["<|file_sep|>"], *tok("filename\n")]
    return ids + [
        special["<|fim_prefix|>"],
        *tok(prefix),
        special["<|fim_suffix|>"],
        *tok(suffix),
        special["<|fim_middle|>"],
    ]


def test_fill_in_the_middle_prompts_token_for_token(srv: Server) -> None:
    _, oa = clients(srv)
    model = model_of(srv)
    prefix, suffix = "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"
    want = fim_ids(srv, prefix, suffix)
    r = httpx.post(
        f"{srv.url}/v1/completions",
        json={"prompt": prefix, "suffix": suffix, "max_tokens": 6, "temperature": 0, "return_token_ids": True},
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["prompt_token_ids"] == want
    extra = [("util.py", "def sub(a, b):\n    return a - b\n")]
    body = {
        "input_prefix": prefix,
        "input_suffix": suffix,
        "input_extra": [{"filename": n, "text": t} for n, t in extra],
        "n_predict": 6,
        "temperature": 0,
    }
    infill = httpx.post(f"{srv.url}/infill", json=body, timeout=60).json()
    assert infill["tokens_evaluated"] == len(fim_ids(srv, prefix, suffix, extra))
    plain = httpx.post(f"{srv.url}/infill", json={**body, "input_extra": []}, timeout=60).json()
    assert plain["content"] == choice["text"] and plain["tokens_predicted"] == 6
    with httpx.stream("POST", f"{srv.url}/infill", json={**body, "input_extra": [], "stream": True}, timeout=60) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    assert "".join(e["content"] for e in events) == plain["content"] and events[-1]["stop"] is True
    ol, _ = clients(srv)
    gen = ol.generate(model=model, prompt=prefix, suffix=suffix, options={"temperature": 0, "num_predict": 6})
    assert gen.response == choice["text"] and gen.prompt_eval_count == len(want)
    streamed = oa.completions.create(
        model=model, prompt=prefix, suffix=suffix, max_tokens=6, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == choice["text"]


def test_fim_on_a_vocabulary_without_fim_tokens_is_400(server: Server) -> None:
    """The shared server's Qwen2 tokenizer (not 2.5's) has no FIM tokens: every FIM route says so, in its shape."""
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "a", "suffix": "b", "max_tokens": 2})
    assert r.status_code == 400 and "fill-in-the-middle" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/infill", json={"input_prefix": "a", "input_suffix": "b"})
    assert r.status_code == 400 and "fill-in-the-middle" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/api/generate", json={"prompt": "a", "suffix": "b"})
    assert r.status_code == 400 and "fill-in-the-middle" in r.json()["error"]


@pytest.fixture(scope="module")
def pooling(qwen2_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(qwen2_ckpt, tmp_path_factory.mktemp("ollama-emb"), "--runner", "pooling")
    yield s
    s.stop()


def test_embed_equals_openai_normalized(pooling: Server) -> None:
    ol, oa = clients(pooling)
    model = model_of(pooling)
    texts = ["the sea", "a longer sentence about the sea"]
    got = ol.embed(model=model, input=texts)
    want = oa.embeddings.create(model=model, input=texts)
    assert len(got.embeddings) == 2 and got.prompt_eval_count == want.usage.prompt_tokens
    for g, w in zip(got.embeddings, want.data, strict=True):
        assert g == pytest.approx(w.embedding, abs=1e-6)
        assert sum(x * x for x in g) == pytest.approx(1.0, abs=1e-4)
    old = ol.embeddings(model=model, prompt="the sea")
    assert len(old.embedding) == len(got.embeddings[0])
    r = httpx.post(f"{pooling.url}/api/chat", json={"model": model, "messages": MSGS})
    assert r.status_code == 400 and set(r.json()) == {"error"}
