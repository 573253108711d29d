"""`--models-dir` against real engine subprocesses: load on first request (streams get keep-alive comments), one load
for concurrent first requests, a request in flight survives another model's load, per-model settings from
models.yaml, a broken model answers 503 for itself only, a model's counters outlive its unload, the idle timeout, an
engine's death unloads its model only, SIGTERM drains every engine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import Server, free_port, wait_healthy
from tests.helpers.processes import children, wait_gone, wait_until


def models_dir(root: Path, ckpt: Path) -> Path:
    """alpha and beta (symlinks to one tiny checkpoint), beta's max_model_len from models.yaml, and a broken one."""
    root.mkdir()
    for name in ("alpha", "beta"):
        (root / name).symlink_to(ckpt)
    (root / "broken").mkdir()
    (root / "broken" / "config.json").write_text('{"model_type": "qwen2"}')  # no weights, no tokenizer
    (root / "models.yaml").write_text("beta:\n  max-model-len: 64\n")
    return root


def start(root: Path, log_dir: Path, *args: str) -> Server:
    port = free_port()
    log = log_dir / f"server-{port}.log"
    cmd = [
        sys.executable,
        "-m",
        "server",
        "--models-dir",
        str(root),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--sse-keepalive",
        "0.2",
        *args,
    ]
    env = {**os.environ, "SPINDLE_LOG_LEVEL": "INFO", "SPINDLE_STRUCTURED_OUTPUTS_WARMUP": "0"}
    popen = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)
    server = Server(popen, port, log, list(args))  # with --api-server-count: healthy in every process
    wait_healthy(server)
    return server


@pytest.fixture(scope="module")
def served(qwen2_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("models")
    server = start(models_dir(tmp / "dir", qwen2_ckpt), tmp)
    yield server
    server.stop()


def loaded(server: Server) -> dict[str, bool]:
    return {card["id"]: card["loaded"] for card in httpx.get(f"{server.url}/v1/models").json()["data"]}


def complete(server: Server, model: str, **body: object) -> httpx.Response:
    return httpx.post(
        f"{server.url}/v1/completions", json={"model": model, "prompt": "Hello", "max_tokens": 4, **body}, timeout=180
    )


def stream_lines(server: Server, model: str, max_tokens: int) -> list[str]:
    body = {"model": model, "prompt": "Hello", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=180) as r:
        assert r.status_code == 200
        return [line for line in r.iter_lines() if line]


def test_every_model_listed_unknown_is_404_and_broken_is_503_for_itself(served: Server) -> None:
    assert loaded(served) == {"alpha": False, "beta": False, "broken": False}
    r = complete(served, "nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    for _ in range(2):  # each request tries the load again
        r = complete(served, "broken")
        assert r.status_code == 503
        assert "`broken` could not be loaded" in r.json()["error"]["message"]
    assert served.metric("spindle_model_load_failures_total", 'model_name="broken"') == 2


def test_concurrent_first_requests_load_once_and_a_stream_gets_keepalives(served: Server) -> None:
    with ThreadPoolExecutor(3) as pool:
        plain = [pool.submit(complete, served, "alpha") for _ in range(2)]
        streamed = pool.submit(stream_lines, served, "alpha", 3)
        assert all(f.result().status_code == 200 for f in plain)
        lines = streamed.result()
    assert lines[0] == ": loading model" and lines[-1] == "data: [DONE]"
    assert sum(1 for line in lines if line.startswith("data: {")) == 3
    assert served.metric("spindle_model_loads_total", 'model_name="alpha"') == 1
    assert loaded(served)["alpha"] is True


def test_a_request_in_flight_survives_another_models_load(served: Server) -> None:
    """--max-loaded-models 1: beta's load must wait for alpha's stream to end, and then unload alpha."""
    body = {"model": "alpha", "prompt": "Hello", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with (
        httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=180) as r,
        ThreadPoolExecutor(1) as pool,
    ):
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: {"))
        beta = pool.submit(complete, served, "beta")
        rest = [line for line in lines if line.startswith("data: ")]
        assert beta.result().status_code == 200
    events = [json.loads(line[6:]) for line in [first, *rest] if line != "data: [DONE]"]
    assert rest[-1] == "data: [DONE]"
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert served.metric("spindle_model_unloads_total", 'model_name="alpha"') == 1
    assert loaded(served) == {"alpha": False, "beta": True, "broken": False}


def test_per_model_settings_from_models_yaml(served: Server) -> None:
    cards = {card["id"]: card for card in httpx.get(f"{served.url}/v1/models").json()["data"]}
    assert cards["beta"]["max_model_len"] == 64
    r = complete(served, "beta", max_tokens=100)  # over beta's 64, under the checkpoint's 1024
    assert r.status_code == 400 and "64" in r.json()["error"]["message"]
    assert served.metric("spindle_models_loaded") == 1
    assert served.metric("spindle_request_success_total", 'model_name="beta"') >= 1


def test_a_models_counters_outlive_its_unload(served: Server) -> None:
    """alpha was unloaded for beta: its counters stay on /metrics and grow on from there when it loads again; beta's
    stay when it is unloaded in turn (Prometheus counters never go down)."""
    assert loaded(served) == {"alpha": False, "beta": True, "broken": False}
    alpha = served.metric("spindle_request_success_total", 'model_name="alpha"')
    latencies = served.metric("spindle_e2e_request_latency_seconds_count", 'model_name="alpha"')
    beta = served.metric("spindle_request_success_total", 'model_name="beta"')
    assert alpha == 4 and latencies == 4 and beta >= 1
    assert complete(served, "alpha").status_code == 200
    assert loaded(served) == {"alpha": True, "beta": False, "broken": False}
    assert served.metric("spindle_request_success_total", 'model_name="alpha"') == alpha + 1
    assert served.metric("spindle_e2e_request_latency_seconds_count", 'model_name="alpha"') == latencies + 1
    assert served.metric("spindle_request_success_total", 'model_name="beta"') == beta


def test_ollama_clients_list_every_model_and_keep_alive_0_unloads(served: Server) -> None:
    """Ollama's model list is the catalog; `keep_alive: 0` unloads the model once its request is done, and a stream
    that waits for the load is NDJSON from its first line (no SSE keep-alive comment)."""
    import ollama  # only this test speaks Ollama's API

    client = ollama.Client(host=served.url, timeout=180)
    assert sorted(m.model or "" for m in client.list().models) == ["alpha", "beta", "broken"]
    client.generate(model="beta", prompt="", keep_alive=0)  # Ollama's unload request (it loads first)
    wait_until(lambda: not loaded(served)["beta"], 60, "beta unloaded")
    assert [m.model for m in client.ps().models if m.model == "beta"] == []
    messages = [{"role": "user", "content": "Hi"}]
    chunks = list(client.chat(model="beta", messages=messages, options={"num_predict": 3}, stream=True, keep_alive=0))
    assert chunks[-1].done and chunks[-1].eval_count == 3
    wait_until(lambda: not loaded(served)["beta"], 60, "beta unloaded after its request")


def streamed_while(server: Server, model: str, max_tokens: int, action: Callable[[], None]) -> list[str]:
    """A stream's `data:` lines, `action()` run once its first event arrived (the model busy meanwhile)."""
    body = {"model": model, "prompt": "Hello", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=180) as r:
        lines = (line for line in r.iter_lines() if line.startswith("data: "))
        first = next(lines)
        assert '"choices"' in first, first
        action()
        return [first, *lines]


def test_idle_timeout_engine_death_and_sigterm_drain(qwen2_ckpt: Path, tmp_path: Path) -> None:
    root = tmp_path / "dir"
    root.mkdir()
    (root / "only").symlink_to(qwen2_ckpt)
    # the drain below must finish 200 tokens within the shutdown timeout, also on a busy machine
    server = start(root, tmp_path, "--model-idle-timeout", "1", "--shutdown-timeout", "120")
    metrics = f"{server.url}/metrics"
    try:
        assert complete(server, "only").status_code == 200
        unloaded = 'spindle_model_unloads_total{model_name="only"} 1.0'
        wait_until(lambda: unloaded in httpx.get(metrics).text, 30, "the idle model unloaded")
        assert loaded(server) == {"only": False}
        # loaded again; its engine dies under a stream: that stream ends in an error and the model is unloaded
        lines = streamed_while(
            server, "only", 1000, lambda: os.kill(children(server.proc.pid, "engine")[0], signal.SIGKILL)
        )
        assert len(lines) < 1000 and any('"error"' in line for line in lines[-2:]), lines[-3:]
        unloaded = 'spindle_model_unloads_total{model_name="only"} 2.0'
        wait_until(lambda: unloaded in httpx.get(metrics).text, 30, "the dead model unloaded")
        # the next request loads it again; SIGTERM while it streams: the stream finishes, then every engine stops
        engines: list[int] = []

        def sigterm() -> None:
            engines.extend(children(server.proc.pid, "engine"))
            server.proc.send_signal(signal.SIGTERM)

        lines = streamed_while(server, "only", 200, sigterm)
        assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert len(engines) == 1
        assert server.proc.wait(60) == 0
        wait_gone(engines, 30)
    finally:
        server.stop()
