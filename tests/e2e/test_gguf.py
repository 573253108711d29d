"""Real GGUF files through the real server: SmolLM2-135M-Instruct (Q4_1, llama, BPE, ChatML in the file) and
Gemma-3-270M (Q4_K_M, SentencePiece, no chat template). Greedy float32 output equals transformers' GGUF-loaded
model token for token; /tokenize equals transformers' GGUF tokenizer; bad files stop the start-up in one line."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import httpx
import pytest
import torch

from engine.cache_root import cache_root
from tests.e2e.conftest import Server, start_server
from tests.engine.gguf.files import gemma3_file, smollm2_file, write_llama
from tests.engine.gguf.hostile import HOSTILE, hostile_file

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
MULTILINGUAL = [
    "Hello, world! Grüße aus München, ça va? ¿Qué tal?",
    "日本語のテキストと中文文本，还有한국어.",
    "Русский текст, ελληνικά, עברית, العربية, हिन्दी 🚀 emoji\n\tand   spaces",
]
NEW_TOKENS = 16


CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def _reference(path: Path) -> dict[str, Any]:
    """transformers' answers from the same GGUF file, float32: every text's token ids, the greedy continuation of
    the first prompts, the chat template's tokens. Kept in the spindle cache under the file's digest and the library
    versions: loading a file (its tokenizer converted, its weights dequantized) costs about a minute of CPU."""
    import transformers

    with path.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    key = json.dumps([digest, transformers.__version__, torch.__version__, PROMPTS, MULTILINGUAL, NEW_TOKENS, CHAT])
    cached = cache_root() / "gguf-reference" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"
    if cached.exists():
        return json.loads(cached.read_text())  # type: ignore[no-any-return]
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    ids = {text: tokenizer(text)["input_ids"] for text in MULTILINGUAL + PROMPTS}
    greedy = {}
    for text in PROMPTS[:2]:  # transformers' generate is the slow part here
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids[text]]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
            )
        greedy[text] = [int(t) for t in out[0, len(ids[text]) :]]
    chat = None
    if tokenizer.chat_template:
        applied = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
        chat = tokenizer(applied, add_special_tokens=False)["input_ids"]
    answers = {"ids": ids, "greedy": greedy, "chat": chat}
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(answers))
    os.replace(tmp, cached)  # two runs at once never read a half-written file
    return answers


def _serve(path: Path, tmp: Path) -> Iterator[Server]:
    server = start_server(path, tmp, "--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "4")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, dict[str, Any]]]:
    path = smollm2_file()
    for server in _serve(path, tmp_path_factory.mktemp("smollm2")):
        yield server, _reference(path)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, dict[str, Any]]]:
    path = gemma3_file()
    for server in _serve(path, tmp_path_factory.mktemp("gemma3")):
        yield server, _reference(path)


def _completion_ids(server: Server, prompt: list[int]) -> list[int]:
    body: dict[str, Any] = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return [int(t) for t in r.json()["choices"][0]["token_ids"]]


def _check_greedy_and_tokenizer(server: Server, ref: dict[str, Any]) -> None:
    for text, want in ref["greedy"].items():
        assert _completion_ids(server, ref["ids"][text]) == want, text
    for text in MULTILINGUAL + PROMPTS:
        r = httpx.post(f"{server.url}/tokenize", json={"model": "tiny", "prompt": text}, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == ref["ids"][text], text


@pytest.mark.timeout(900)
def test_smollm2_greedy_tokenizer_and_chat_template(smollm2: tuple[Server, dict[str, Any]]) -> None:
    server, ref = smollm2
    _check_greedy_and_tokenizer(server, ref)
    chat = {"model": "tiny", "messages": CHAT, "max_tokens": 20, "temperature": 0}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=120)
    assert r.status_code == 200, r.text
    assert "Paris" in r.json()["choices"][0]["message"]["content"]
    r = httpx.post(f"{server.url}/tokenize", json={"model": "tiny", "messages": CHAT}, timeout=30)
    assert ref["chat"] is not None and r.json()["tokens"] == ref["chat"]


@pytest.mark.timeout(900)
def test_gemma3_greedy_tokenizer_and_no_chat_template(gemma3: tuple[Server, dict[str, Any]]) -> None:
    server, ref = gemma3
    _check_greedy_and_tokenizer(server, ref)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 400, r.text
    assert "chat template" in r.json()["error"]["message"]


def test_a_lora_adapter_on_a_gguf_base_equals_peft(tmp_path: Path) -> None:
    """The adapter's product is added to the quantized projections' (Q8_0 blocks kept): greedy == peft on
    transformers' GGUF-loaded base."""
    from transformers import AutoModelForCausalLM

    from tests.helpers.lora import peft_greedy, write_adapter

    path = tmp_path / "small.gguf"
    write_llama(path, qtype=gguf.GGMLQuantizationType.Q8_0)
    base = tmp_path / "base-hf"  # the same weights as transformers dequantizes them, for peft
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32)
    loaded.config.__dict__.pop("quantization_config", None)  # a GGUF-loaded model is not saved as such
    plain = AutoModelForCausalLM.from_config(loaded.config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.save_pretrained(base)
    adapter = write_adapter(base, tmp_path / "a1", r=8, targets=["q_proj", "v_proj", "down_proj"], seed=5, alpha=256)
    server = start_server(path, tmp_path, "--dtype", "float32", "--enable-lora", "--lora-modules", f"a1={adapter}")
    try:
        prompt = [5, 17, 33, 60, 2]
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        got = {
            m: httpx.post(f"{server.url}/v1/completions", json={"model": m, **body}, timeout=120).json()
            for m in ("tiny", "a1")
        }
        want = peft_greedy(base, adapter, prompt, 8)
        assert got["a1"]["choices"][0]["token_ids"] == want
        assert got["tiny"]["choices"][0]["token_ids"] != want
    finally:
        server.stop()


def _start_fails(model: Path) -> str:
    """`spindle serve --model FILE` on a bad file: exit status 2 and one line on stderr."""
    out = subprocess.run(
        [sys.executable, "-m", "server", "--model", str(model), "--port", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    return lines[0]


def test_bad_files_stop_the_start_in_one_line(tmp_path: Path) -> None:
    good = tmp_path / "good.gguf"
    write_llama(good)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    assert "runs past the end of the file" in _start_fails(cut)
    text = tmp_path / "notes.gguf"
    text.write_text("not a model")
    assert "is not a GGUF file" in _start_fails(text)
    bert = tmp_path / "bert.gguf"
    write_llama(bert, arch="bert")
    assert "architecture 'bert' is not supported; supported: llama" in _start_fails(bert)


# Runs `spindle serve` and prints its exit status, stderr's lines and its peak resident memory (KiB) as JSON.
_PEAK = """
import json, resource, subprocess, sys
out = subprocess.run([sys.executable, "-m", "server", "--model", sys.argv[1], "--port", "1"], capture_output=True,
                     text=True, timeout=60)
peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
print(json.dumps({"rc": out.returncode, "lines": out.stderr.strip().splitlines(), "peak_kib": peak}))
"""


@pytest.mark.parametrize("what", HOSTILE)
def test_a_hostile_file_stops_the_start_in_one_line_within_bounds(what: str, tmp_path: Path) -> None:
    """Each file past a limit of docs/gguf.md: exit status 2, one line naming the file and the limit, within 60 s,
    the process under 2 GiB."""
    path, words = hostile_file(tmp_path, what)
    run = subprocess.run([sys.executable, "-c", _PEAK, str(path)], capture_output=True, text=True, timeout=90)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout)
    assert got["rc"] == 2 and len(got["lines"]) == 1, got["lines"][-20:]
    assert str(path) in got["lines"][0] and words in got["lines"][0], got["lines"][0]
    assert got["peak_kib"] < 2 << 20, got["peak_kib"]
