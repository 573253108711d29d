"""The real server on the new families: a MoE one (Qwen3-MoE), a sliding-window one with soft-caps (Gemma 2), one
with NoPE layers (SmolLM3), one with OLMo's closing norms and windows (OLMo 3) and Gemma 4 (per-layer inputs, layers
sharing K/V) answer completions, streams and chat with transformers' greedy tokens; an unsupported architecture
stops start-up with one line naming it and the supported ones, and no stack trace."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from tests.e2e.conftest import Server, start_server
from tests.engine.models.families import build_family

PROMPT = [(7919 * i) % 30_000 + 100 for i in range(40)]  # longer than Gemma 2's window of 8
NEW = 8


@pytest.fixture(scope="module", params=["qwen3_moe", "gemma2", "smollm3", "olmo3", "gemma4"])
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Server]]:
    ckpt = build_family(tmp_path_factory.mktemp("fam"), str(request.param))
    srv = start_server(ckpt, tmp_path_factory.mktemp("srv"), "--dtype", "float32")  # token for token: float32
    yield ckpt, srv
    srv.stop()


def hf_greedy(ckpt: Path, prompt: list[int]) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW,
            min_new_tokens=NEW,
            do_sample=False,
            repetition_penalty=1.0,
            top_k=None,
            top_p=None,
            temperature=None,
            eos_token_id=None,
            pad_token_id=0,
        )
    return list(out[0, len(prompt) :].tolist())


def test_completion_stream_and_chat_match_transformers(family: tuple[Path, Server]) -> None:
    ckpt, srv = family
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": NEW, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{srv.url}/v1/completions", json={**body, "return_token_ids": True}, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == hf_greedy(ckpt, PROMPT) and choice["finish_reason"] == "length"
    streamed = ""
    with httpx.stream("POST", f"{srv.url}/v1/completions", json={**body, "stream": True}, timeout=60) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                streamed += "".join(c["text"] for c in json.loads(line[6:])["choices"])
    assert streamed == choice["text"]
    chat = httpx.post(
        f"{srv.url}/v1/chat/completions",
        timeout=60,
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "tell me about sliding windows " * 4}],
            "max_tokens": NEW,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["completion_tokens"] == NEW


def test_unsupported_architecture_fails_startup_in_one_line(qwen2_ckpt: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "gpt2"
    shutil.copytree(qwen2_ckpt, ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(cfg | {"architectures": ["GPT2LMHeadModel"]}))
    srv = start_server(ckpt, tmp_path, wait=False)
    assert srv.proc.wait(120) != 0
    log = srv.log.read_text()
    lines = [line for line in log.splitlines() if "GPT2LMHeadModel" in line]
    assert len(lines) == 1, log
    assert "architecture GPT2LMHeadModel is not supported; supported: LlamaForCausalLM" in lines[0]
    assert "Qwen3MoeForCausalLM" in lines[0] and "Gemma3ForCausalLM" in lines[0]
    assert "Traceback" not in log, log
