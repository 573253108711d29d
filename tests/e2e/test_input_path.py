"""Issue 4 over real HTTP, default flags (the session server): lengths, validation wiring, bodies,
request ids, n > 1, /tokenize, /detokenize, the render routes, /inference/v1/generate, and the event loop
staying responsive while a 100k-token prompt is tokenized.

References: the checkpoint's own tokenizer (HF `tokenizers`) and the server's regular routes.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import tokenizers

from tests.e2e.conftest import Server
from tests.e2e.sse import events
from tests.helpers.responses import assert_error

pytestmark = pytest.mark.anyio
CHAT = [{"role": "user", "content": "Say something."}]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def tok(qwen2_ckpt: Path) -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_file(str(qwen2_ckpt / "tokenizer.json"))


@pytest.fixture(scope="module")
def max_len(server: Server) -> int:
    return int(httpx.get(f"{server.url}/v1/models").json()["data"][0]["max_model_len"])


def post(server: Server, path: str, body: Any, **kw: Any) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60, **kw)


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 30000) for _ in range(n)]


def words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    vocab = ["hello", "world", "the", "quick", "brown", "fox", "über", "数据", "lazy", "dog", "1234", "\n"]
    return " ".join(rng.choice(vocab) for _ in range(n))


# ------------------------------------------------------------------------------ lengths and validation


def test_prompt_lengths_at_and_around_max_model_len(server: Server, max_len: int) -> None:
    at = post(server, "/v1/completions", {"prompt": ids(max_len, 1), "max_tokens": 1})
    assert_error(at, 400, f"maximum context length is {max_len}", f"{max_len} input tokens")
    over = post(server, "/v1/completions", {"prompt": ids(max_len - 1, 2), "max_tokens": 2})
    err = assert_error(over, 400, f"{max_len + 1} tokens", f"{max_len - 1} in the input", "2 in the completion")
    assert err["param"] == "max_tokens"
    under = post(server, "/v1/completions", {"prompt": ids(max_len - 1, 3), "max_tokens": 1, "ignore_eos": True})
    assert under.status_code == 200 and under.json()["usage"]["total_tokens"] == max_len
    # max_tokens null: the room left
    rest = post(server, "/v1/completions", {"prompt": ids(max_len - 3, 4), "ignore_eos": True})
    assert rest.status_code == 200, rest.text
    assert rest.json()["usage"]["completion_tokens"] == 3 and rest.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("temperature", -0.5, "temperature"),
        ("top_p", 0.0, "top_p"),
        ("n", 0, "n must be"),
        ("logprobs", 21, "--max-logprobs"),
        ("presence_penalty", 2.5, "presence_penalty"),
        ("stop", [""], "empty"),
        ("seed", 1 << 63, "64 bits"),
        ("stop_token_ids", [10**7], "outside the vocabulary"),
        ("max_tokens", 0, "at least 1"),
        ("logit_bias", {"abc": 1}, "token ids"),
    ],
)
def test_sampling_fields_are_checked(server: Server, field: str, value: Any, needle: str) -> None:
    r = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, field: value})
    assert assert_error(r, 400, needle)["param"] == field


def test_prompt_token_outside_vocabulary(server: Server) -> None:
    assert_error(post(server, "/v1/completions", {"prompt": [1, 10**7], "max_tokens": 1}), 400, "out of vocabulary")


def test_truncate_prompt_tokens_keeps_the_last_n(server: Server) -> None:
    prompt = ids(40, 5)
    r = post(
        server,
        "/v1/completions",
        {"prompt": prompt, "max_tokens": 1, "truncate_prompt_tokens": 7, "return_token_ids": True},
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["prompt_token_ids"] == prompt[-7:] and r.json()["usage"]["prompt_tokens"] == 7


# ------------------------------------------------------------------------------------------ bodies


@pytest.mark.parametrize(
    "path",
    [
        "/v1/completions",
        "/v1/chat/completions",
        "/tokenize",
        "/detokenize",
        "/v1/completions/render",
        "/v1/chat/completions/render",
        "/inference/v1/generate",
    ],
)
def test_bodies_that_are_not_json_objects(server: Server, path: str) -> None:
    for body in (b"not json", b"null", b"[1, 2]", b"3", b'"text"', b"{"):
        r = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"})
        assert_error(r, 400)
    wrong = httpx.post(server.url + path, content=b"{}", headers={"content-type": "text/plain"})
    assert_error(wrong, 415, "application/json")
    form = httpx.post(server.url + path, data={"prompt": "x"})  # what `curl -d` sends
    assert_error(form, 415)


def test_json_with_charset_is_accepted(server: Server) -> None:
    r = httpx.post(
        server.url + "/tokenize",
        content=b'{"prompt": "hi"}',
        headers={"content-type": "application/json; charset=utf-8"},
    )
    assert r.status_code == 200, r.text


# ------------------------------------------------------------------------------------- request ids


async def test_same_external_id_twice_at_once(server: Server) -> None:
    """Internal ids get a random suffix: two requests with one X-Request-Id run side by side."""
    results: list[httpx.Response] = []

    async def one(client: httpx.AsyncClient) -> None:
        results.append(
            await client.post(
                "/v1/completions",
                json={"prompt": "Hi", "max_tokens": 12, "ignore_eos": True},
                headers={"x-request-id": "same-id"},
            )
        )

    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client, anyio.create_task_group() as tg:
        tg.start_soon(one, client)
        tg.start_soon(one, client)
    for r in results:
        assert r.status_code == 200 and r.json()["id"] == "cmpl-same-id" and r.headers["x-request-id"] == "same-id"
        assert r.json()["usage"]["completion_tokens"] == 12


# -------------------------------------------------------------------------------------------- n > 1


def test_n_children_share_the_prompt_and_reassemble(server: Server, tok: tokenizers.Tokenizer) -> None:
    prompt = words(120, seed=int(time.time_ns() % 10**9))  # fresh text: nothing cached before
    n_prompt = len(tok.encode(prompt).ids)
    body = {"prompt": prompt, "n": 3, "max_tokens": 6, "seed": 11, "temperature": 1.0, "ignore_eos": True}
    whole = post(server, "/v1/completions", body).json()
    usage = whole["usage"]
    assert usage["prompt_tokens"] == n_prompt and usage["completion_tokens"] == 18  # the prompt counts once
    texts = [c["text"] for c in sorted(whole["choices"], key=lambda c: c["index"])]
    assert len(set(texts)) > 1  # derived seeds: the choices differ
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        chunks = [e for e in events(r)]
    streamed = ["", "", ""]
    for e in chunks:
        for c in e["choices"]:
            streamed[c["index"]] += c["text"]
    assert streamed == texts  # same seeds, same choices, reassembled by index
    assert any(len(e["choices"]) > 1 for e in chunks)  # one event carries several choices


def test_n_children_compute_the_prompt_once(server: Server) -> None:
    prompt = words(120, seed=int(time.time_ns() % 10**9) + 1)  # fresh text: nothing cached before
    body = {"prompt": prompt, "n": 3, "max_tokens": 2, "ignore_eos": True}
    usage = post(server, "/v1/completions", body).json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 16  # children reused the first one's blocks


# ----------------------------------------------------------------------------- tokenize / detokenize


def test_tokenize_prompt_and_detokenize(server: Server, tok: tokenizers.Tokenizer, max_len: int) -> None:
    text = "Hello, wörld! 数据 <|im_end|>"
    r = post(server, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    ref = tok.encode(text).ids
    assert r == {
        "count": len(ref),
        "max_model_len": max_len,
        "tokens": ref,
        "token_strs": [tok.id_to_token(i) for i in ref],
    }
    back = post(server, "/detokenize", {"tokens": ref}).json()
    assert back == {"prompt": tok.decode(ref, skip_special_tokens=False)}
    assert_error(post(server, "/detokenize", {"tokens": [10**7]}), 400, "vocabulary")
    assert_error(post(server, "/tokenize", {}), 400, "exactly one")


def test_tokenize_messages_matches_the_chat_route(server: Server, tok: tokenizers.Tokenizer) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]
    as_parts = post(server, "/tokenize", {"messages": parts}).json()
    as_text = post(server, "/tokenize", {"messages": [{"role": "user", "content": "one\ntwo"}]}).json()
    assert as_parts["tokens"] == as_text["tokens"]
    assert tok.decode(as_text["tokens"], skip_special_tokens=False).endswith(
        "<|im_start|>user\none\ntwo<|im_end|>\n<|im_start|>assistant\n"
    )
    chat = post(server, "/v1/chat/completions", {"messages": parts, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == as_parts["count"]
    no_prompt = post(server, "/tokenize", {"messages": parts, "add_generation_prompt": False}).json()
    assert as_parts["tokens"][: no_prompt["count"]] == no_prompt["tokens"] and no_prompt["count"] < as_parts["count"]


def test_chat_template_options(server: Server) -> None:
    both = post(server, "/v1/chat/completions", {"messages": CHAT, "continue_final_message": True})
    assert_error(both, 400, "add_generation_prompt")
    own = post(server, "/v1/chat/completions", {"messages": CHAT, "chat_template": "{{ 1 }}"})
    assert_error(own, 400, "--trust-request-chat-template")
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    assert_error(post(server, "/v1/chat/completions", {"messages": image}), 400, "text")


# ----------------------------------------------------------------------------- render and generate


def test_completions_render(server: Server, tok: tokenizers.Tokenizer, max_len: int) -> None:
    r = post(
        server,
        "/v1/completions/render",
        {"prompt": ["one two", "three"], "seed": 5, "stop": ["x"]},
        headers={"x-request-id": "r1"},
    )
    assert r.status_code == 200, r.text
    first, second = r.json()
    assert first["token_ids"] == tok.encode("one two").ids and second["token_ids"] == tok.encode("three").ids
    assert first["request_id"] == "r1"
    sp = first["sampling_params"]
    assert sp["max_tokens"] == max_len - len(first["token_ids"]) and sp["seed"] == 5 and sp["stop"] == ["x"]
    long = post(server, "/v1/completions/render", {"prompt": ids(max_len, 9)})
    assert_error(long, 400, "maximum context length")


def test_chat_render_then_generate_equals_chat_completions(server: Server) -> None:
    body = {"messages": CHAT, "max_tokens": 8, "seed": 3, "temperature": 1.0, "ignore_eos": True}
    rendered = post(server, "/v1/chat/completions/render", body)
    assert rendered.status_code == 200, rendered.text
    gen_req = rendered.json()
    assert gen_req["token_ids"] == post(server, "/tokenize", {"messages": CHAT}).json()["tokens"]
    out = post(server, "/inference/v1/generate", gen_req)
    assert out.status_code == 200, out.text
    chat = post(server, "/v1/chat/completions", {**body, "return_token_ids": True}).json()
    choice = out.json()["choices"][0]
    assert choice["token_ids"] == chat["choices"][0]["token_ids"] and choice["finish_reason"] == "length"
    assert out.json()["request_id"] == gen_req["request_id"]
    # streaming, n = 2: each choice's token ids arrive in pieces, by index
    with httpx.stream(
        "POST",
        server.url + "/inference/v1/generate",
        timeout=60,
        json={**gen_req, "stream": True, "sampling_params": {**gen_req["sampling_params"], "n": 2}},
    ) as r:
        got: dict[int, list[int]] = {0: [], 1: []}
        for e in events(r):
            for c in e["choices"]:
                got[c["index"]] += c["token_ids"]
    assert got[0] == choice["token_ids"] and len(got[1]) == 8  # child 0 keeps the seed, child 1 gets seed + 1


def test_generate_validates_like_completions(server: Server, max_len: int) -> None:
    assert_error(post(server, "/inference/v1/generate", {"token_ids": []}), 400, "empty")
    assert_error(post(server, "/inference/v1/generate", {"token_ids": [5, 10**7]}), 400, "vocabulary")
    too_long = {"token_ids": ids(max_len - 1, 1), "sampling_params": {"max_tokens": 5}}
    assert_error(post(server, "/inference/v1/generate", too_long), 400, "maximum context length")
    bad = {"token_ids": [5], "sampling_params": {"top_p": 1.5}}
    assert_error(post(server, "/inference/v1/generate", bad), 400, "top_p")


# ------------------------------------------------------------------ the event loop during tokenization


async def test_health_and_streams_answer_while_100k_tokens_are_tokenized(
    server: Server, tok: tokenizers.Tokenizer
) -> None:
    text = words(75_000, seed=1)
    expected = len(tok.encode(text).ids)
    assert expected > 95_000
    window: list[float] = []
    health_done: list[float] = []
    stream_times: list[float] = []
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        first_token = anyio.Event()
        tokenized = anyio.Event()

        async def stream() -> None:
            body = {"prompt": "Hi", "max_tokens": 900, "ignore_eos": True, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as r:
                async for _ in r.aiter_lines():
                    stream_times.append(time.monotonic())
                    first_token.set()
                    if tokenized.is_set():
                        return  # disconnect: the server aborts it

        async def tokenize() -> None:
            await first_token.wait()
            window.append(time.monotonic())
            r = await client.post("/tokenize", json={"prompt": text})
            window.append(time.monotonic())
            tokenized.set()
            assert r.status_code == 200 and r.json()["count"] == expected

        async def health() -> None:
            await first_token.wait()
            async with httpx.AsyncClient(base_url=server.url, timeout=10) as own:
                while not tokenized.is_set():
                    assert (await own.get("/health")).status_code == 200
                    health_done.append(time.monotonic())

        async with anyio.create_task_group() as tg:
            tg.start_soon(stream)
            tg.start_soon(tokenize)
            tg.start_soon(health)
    start, end = window
    inside = [t for t in health_done if start < t < end]
    assert len(inside) >= 3, (end - start, len(health_done))  # /health kept answering while it was tokenized
    assert sum(start < t < end for t in stream_times) >= 3  # and the running stream kept flowing
