"""`spindle render`: the render routes with no engine and no torch in the process tree; the same answers as
`spindle serve`; generation routes 404 naming `spindle serve`."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import Server, free_port, start_server, wait_healthy

KEY = "render-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 5}


def start_render(model: Path, tmp: Path, *args: str) -> Server:
    port = free_port()
    log = tmp / f"render-{port}.log"
    cmd = [
        sys.executable,
        "-m",
        "server",
        "render",
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        "tiny",
        *args,
    ]
    proc = subprocess.Popen(
        cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env={**os.environ, "SPINDLE_LOG_LEVEL": "WARNING"}
    )
    server = Server(proc, port, log, list(args))
    wait_healthy(server)
    return server


def process_tree(pid: int) -> list[int]:
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [pid, *(p for child in children for p in process_tree(int(child)))]


@pytest.fixture(scope="module")
def render(qwen2_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_render(qwen2_ckpt, tmp_path_factory.mktemp("render"), "--api-key", KEY, "--renderer-num-workers", "2")
    yield s
    s.stop()


def test_render_server_answers_render_routes_without_torch(render: Server) -> None:
    url = render.url
    long_text = "word " * 400  # past the inline limit: tokenized in a render worker
    tok = httpx.post(f"{url}/tokenize", json={"model": "tiny", "prompt": long_text}, headers=AUTH, timeout=30)
    assert tok.status_code == 200, tok.text
    assert tok.json()["count"] > 100 and tok.json()["max_model_len"] > 0
    back = httpx.post(f"{url}/detokenize", json={"tokens": tok.json()["tokens"]}, headers=AUTH, timeout=30)
    assert back.status_code == 200 and back.json()["prompt"].startswith("word word")
    chat = httpx.post(f"{url}/tokenize", json={"messages": CHAT["messages"]}, headers=AUTH, timeout=30)
    assert chat.status_code == 200 and chat.json()["count"] > 3
    rendered = httpx.post(f"{url}/v1/chat/completions/render", json=CHAT, headers=AUTH, timeout=30)
    assert rendered.status_code == 200, rendered.text
    assert rendered.json()["token_ids"] == chat.json()["tokens"]
    comp = httpx.post(f"{url}/v1/completions/render", json={"model": "tiny", "prompt": "Hi"}, headers=AUTH, timeout=30)
    assert comp.status_code == 200 and len(comp.json()) == 1
    models = httpx.get(f"{url}/v1/models", headers=AUTH, timeout=10)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "tiny"
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200  # public
    assert httpx.get(f"{url}/metrics", timeout=10).status_code == 401  # the same auth as `spindle serve`
    assert httpx.get(f"{url}/metrics", headers=AUTH, timeout=10).status_code == 200
    # The same validation: an over-long request is refused as the full server refuses it.
    too_long = httpx.post(
        f"{url}/v1/chat/completions/render", json={**CHAT, "max_tokens": 10**9}, headers=AUTH, timeout=30
    )
    assert too_long.status_code == 400, too_long.text

    pids = process_tree(render.proc.pid)
    assert len(pids) >= 3, pids  # the server and its two render workers; no engine
    for pid in pids:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        assert b"engine" not in cmdline, cmdline
        maps = Path(f"/proc/{pid}/maps").read_text()
        assert "libtorch" not in maps and "/torch/" not in maps, f"torch loaded in {cmdline!r}"


@pytest.mark.parametrize(
    "path", ["/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/embeddings", "/inference/v1/generate"]
)
def test_generation_routes_name_spindle_serve(render: Server, path: str) -> None:
    r = httpx.post(f"{render.url}{path}", json=CHAT, headers=AUTH, timeout=10)
    assert r.status_code == 404
    assert "spindle serve" in r.json()["error"]["message"]


def test_render_matches_the_full_server(render: Server, qwen2_ckpt: Path, tmp_path: Path) -> None:
    full = start_server(qwen2_ckpt, tmp_path)
    try:
        for path, body in (
            ("/v1/chat/completions/render", CHAT),
            ("/v1/completions/render", {"model": "tiny", "prompt": "Hi there", "max_tokens": None}),
            ("/tokenize", {"model": "tiny", "messages": CHAT["messages"]}),
        ):
            want = httpx.post(f"{full.url}{path}", json=body, headers={"X-Request-Id": "r1"}, timeout=30)
            got = httpx.post(f"{render.url}{path}", json=body, headers={**AUTH, "X-Request-Id": "r1"}, timeout=30)
            assert want.status_code == got.status_code == 200, (want.text, got.text)
            assert got.json() == want.json(), path
    finally:
        full.stop()


def test_render_needs_a_model() -> None:
    out = subprocess.run([sys.executable, "-m", "server", "render"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--model" in out.stderr


def _plain_hypercorn(port: int, log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """`hypercorn 'server.app:create_app()'`, configured by SPINDLE_* variables only."""
    return subprocess.Popen(
        [sys.executable, "-m", "hypercorn", "server.app:create_app()", "-k", "trio", "--bind", f"127.0.0.1:{port}"],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        env=env,
    )


def test_render_only_under_plain_hypercorn_serves_without_torch(qwen2_ckpt: Path, tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "hypercorn.log"
    env = {
        **os.environ,
        "SPINDLE_RENDER_ONLY": "1",
        "SPINDLE_MODEL": str(qwen2_ckpt),
        "SPINDLE_SERVED_MODEL_NAME": "tiny",
        "SPINDLE_LOG_LEVEL": "WARNING",
    }
    server = Server(_plain_hypercorn(port, log, env), port, log)
    wait_healthy(server)
    try:
        tok = httpx.post(f"{server.url}/tokenize", json={"model": "tiny", "prompt": "Hello there"}, timeout=30)
        assert tok.status_code == 200 and tok.json()["count"] > 0, tok.text
        gen = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "Hi"}, timeout=10)
        assert gen.status_code == 404 and "spindle serve" in gen.json()["error"]["message"]
        for pid in process_tree(server.proc.pid):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            assert b"engine" not in cmdline, cmdline
            maps = Path(f"/proc/{pid}/maps").read_text()
            assert "libtorch" not in maps and "/torch/" not in maps, f"torch loaded in {cmdline!r}"
    finally:
        server.stop()


def test_render_only_under_plain_hypercorn_needs_a_model(tmp_path: Path) -> None:
    """The same refusal as `spindle render` without --model (test_render_needs_a_model), not a demo build."""
    log = tmp_path / "hypercorn.log"
    env = {k: v for k, v in os.environ.items() if k != "SPINDLE_MODEL"}
    proc = _plain_hypercorn(free_port(), log, {**env, "SPINDLE_RENDER_ONLY": "1"})
    proc.wait(60)  # Hypercorn gives up on an app that does not load
    assert "spindle render needs --model" in log.read_text()
