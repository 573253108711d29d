"""Issue 4 over real HTTP with non-default flags (one module server): API keys on every route, the body
size limit, admission 503s, request chat templates (kwargs, runaway and escaping templates) and a
checkpoint without a chat template.

Flags: SPINDLE_API_KEY="k1,k2" (the env form of --api-key), --metrics-public, --trust-request-chat-template,
--chat-template-render-timeout 1, --max-num-queued-reqs 2, --max-num-queued-tokens 1500,
SPINDLE_MAX_REQUEST_BODY=65536, SPINDLE_DEFAULT_CHAT_TEMPLATE_KWARGS.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import tokenizers

from tests.e2e.conftest import Server, start_server
from tests.helpers.responses import assert_error

pytestmark = pytest.mark.anyio
KEYS = ("k1", "k2")
AUTH = {"Authorization": "Bearer k2"}
CHAT = [{"role": "user", "content": "hi"}]
# 10^10 loop iterations, each under the sandbox's range cap
LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"
GIANT = "{% set s = 'x' * 100000 %}{% for i in range(100000) %}{{ s }}{% endfor %}"
ESCAPES = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.environ }}",
    "{{ self._TemplateReference__context }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def guarded(qwen2_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("guarded")
    ckpt = tmp / "no-template"  # the same checkpoint without its chat template
    ckpt.mkdir()
    for f in qwen2_ckpt.iterdir():
        if f.name != "tokenizer_config.json":
            (ckpt / f.name).symlink_to(f)
    config = json.loads((qwen2_ckpt / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (ckpt / "tokenizer_config.json").write_text(json.dumps(config))
    env = {
        "SPINDLE_API_KEY": ",".join(KEYS),
        "SPINDLE_MAX_REQUEST_BODY": "65536",
        "SPINDLE_DEFAULT_CHAT_TEMPLATE_KWARGS": json.dumps({"greeting": "hello", "other": "o"}),
    }
    s = start_server(
        ckpt,
        tmp,
        "--metrics-public",
        "--trust-request-chat-template",
        "--chat-template-render-timeout",
        "1",
        "--max-num-queued-reqs",
        "2",
        "--max-num-queued-tokens",
        "1500",
        env=env,
    )
    yield s
    s.stop()
    shutil.rmtree(ckpt, ignore_errors=True)


def post(server: Server, path: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=AUTH if headers is None else headers, timeout=60)


ROUTES = [
    ("GET", "/v1/models"),
    ("GET", "/version"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("POST", "/v1/completions/render"),
    ("POST", "/v1/chat/completions/render"),
    ("POST", "/inference/v1/generate"),
    ("GET", "/nope"),
]


def test_api_key_guards_every_route(guarded: Server) -> None:
    for method, path in ROUTES:
        for headers in (
            {},
            {"Authorization": "Bearer k3"},
            {"Authorization": "Bearer k1x"},
            {"Authorization": "k1"},
            {"Authorization": "Basic k1"},
        ):
            r = httpx.request(method, guarded.url + path, json={}, headers=headers)
            assert_error(r, 401, "API key")
            assert r.headers["www-authenticate"] == "Bearer"
        for key in KEYS:  # every key works; the route then answers on its own terms
            r = httpx.request(method, guarded.url + path, json={}, headers={"Authorization": f"bearer {key}"})
            assert r.status_code != 401, (path, r.text)
    assert httpx.get(guarded.url + "/health").status_code == 200
    assert httpx.get(guarded.url + "/metrics").status_code == 200  # --metrics-public


def test_body_size_limit(guarded: Server) -> None:
    big = {"prompt": "x" * 70_000, "max_tokens": 1}
    assert_error(post(guarded, "/v1/completions", big), 413, "65536")
    assert_error(post(guarded, "/tokenize", big), 413)
    assert post(guarded, "/tokenize", {"prompt": "x" * 60_000}).status_code == 200


def test_no_chat_template(guarded: Server) -> None:
    r = post(guarded, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1})
    assert_error(r, 400, "no chat template", "--chat-template")
    assert_error(post(guarded, "/tokenize", {"messages": CHAT}), 400, "--chat-template")
    ok = post(guarded, "/v1/completions", {"prompt": "Hello", "max_tokens": 2, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_template_kwargs_tools_documents(guarded: Server, qwen2_ckpt: Path) -> None:
    template = (
        "{{ greeting }}|{{ other }}|{{ tools[0].function.name }}|{{ documents[0].title }}|"
        "{{ messages[0].content }}{% if add_generation_prompt %}>{% endif %}"
    )
    body = {
        "messages": CHAT,
        "chat_template": template,
        "chat_template_kwargs": {"greeting": "hey"},
        "tools": [{"type": "function", "function": {"name": "fn"}}],
        "documents": [{"title": "doc"}],
    }
    got = post(guarded, "/tokenize", body).json()["tokens"]
    tok = tokenizers.Tokenizer.from_file(str(qwen2_ckpt / "tokenizer.json"))
    assert got == tok.encode("hey|o|fn|doc|hi>", add_special_tokens=False).ids  # request kwargs over defaults
    rendered = post(guarded, "/v1/chat/completions/render", {**body, "add_generation_prompt": False}).json()
    assert rendered["token_ids"] == tok.encode("hey|o|fn|doc|hi", add_special_tokens=False).ids


def test_admission_counts_n_and_tokens(guarded: Server) -> None:
    r = post(guarded, "/v1/completions", {"prompt": "Hi", "n": 3, "max_tokens": 1})
    assert_error(r, 503, "3 queue slots", "--max-num-queued-reqs")
    assert r.headers["retry-after"] == "1"
    ids = [random.Random(0).randrange(1000, 30000) for _ in range(800)]
    assert_error(
        post(guarded, "/v1/completions", {"prompt": ids, "n": 2, "max_tokens": 1}),
        503,
        "1600",
        "--max-num-queued-tokens 1500",
    )
    ok = post(guarded, "/v1/completions", {"prompt": ids[:700], "n": 2, "max_tokens": 1})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2
    # refused before rendering: a template that would run for the whole render timeout is never started
    start = time.monotonic()
    r = post(guarded, "/v1/chat/completions", {"messages": CHAT, "chat_template": LOOP, "n": 3})
    assert_error(r, 503, "3 queue slots")
    assert time.monotonic() - start < 0.9  # the render timeout is 1 s


def render_workers(server: Server) -> list[int]:
    out = subprocess.run(
        ["pgrep", "-P", str(server.proc.pid), "-f", "server.render.render_worker"], capture_output=True, text=True
    )
    return [int(p) for p in out.stdout.split()]


def cpu_stopped(pid: int) -> bool:
    """Gone, or a zombie: either way it burns no CPU."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


async def test_runaway_template_is_stopped_while_a_stream_flows(guarded: Server) -> None:
    before = render_workers(guarded)
    assert before
    stream_times: list[float] = []
    window: list[float] = []
    async with httpx.AsyncClient(base_url=guarded.url, headers=AUTH, timeout=60) as client:
        first_token, rendered = anyio.Event(), anyio.Event()

        async def stream() -> None:
            body = {"prompt": "Hi", "max_tokens": 900, "ignore_eos": True, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as r:
                async for _ in r.aiter_lines():
                    stream_times.append(time.monotonic())
                    first_token.set()
                    if rendered.is_set():
                        return

        async def render() -> None:
            await first_token.wait()
            window.append(time.monotonic())
            r = await client.post("/v1/chat/completions", json={"messages": CHAT, "chat_template": LOOP})
            window.append(time.monotonic())
            rendered.set()
            assert_error(r, 400, "longer than 1.0 s")

        async with anyio.create_task_group() as tg:
            tg.start_soon(stream)
            tg.start_soon(render)
    start, end = window
    assert 0.9 < end - start < 5
    assert sum(start < t < end for t in stream_times) >= 10  # the other stream kept flowing
    assert all(cpu_stopped(pid) for pid in before)  # the worker that ran it was killed, not abandoned
    # a fresh worker serves the next request
    ok = post(guarded, "/tokenize", {"prompt": "a" * 2000})
    assert ok.status_code == 200 and ok.json()["count"] > 0


def test_giant_string_and_escapes_are_400s(guarded: Server) -> None:
    r = post(guarded, "/v1/chat/completions", {"messages": CHAT, "chat_template": GIANT})
    assert_error(r, 400)
    secrets = [k for k in KEYS] + [os.environ.get("HOME", "/root"), "<class", "subprocess", "environ("]
    for template in ESCAPES:
        r = post(guarded, "/v1/chat/completions", {"messages": CHAT, "chat_template": template, "max_tokens": 1})
        assert_error(r, 400)
        for secret in secrets:
            assert secret not in r.text, (template, r.text)
    assert post(guarded, "/tokenize", {"prompt": "still fine"}).status_code == 200


def test_render_workers_start_without_the_servers_secrets(guarded: Server) -> None:
    """The server holds SPINDLE_API_KEY; the workers that run request templates never see it."""
    assert post(guarded, "/tokenize", {"prompt": "a" * 2000}).status_code == 200  # the workers are up
    out = subprocess.run(
        ["pgrep", "-P", str(guarded.proc.pid), "-f", "server.render.render_worker"], capture_output=True, text=True
    )
    pids = [int(p) for p in out.stdout.split()]
    assert pids
    for pid in pids:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
        env = dict(item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
        assert b"SPINDLE_API_KEY" not in env and not any(b"k1,k2" in v for v in env.values())
        assert env[b"PATH"] and env[b"PYTHONPATH"]
