"""GGUF files of the 2026 families (SmolLM3, OLMo 2, OLMo 3 filed as olmo2, LFM2), written from a random checkpoint as
llama.cpp's converter lays them out: config derived from the metadata (engine/gguf/arch_config.py), tensors by HF name,
and greedy through the engine equal to transformers on the checkpoint (float32 and F16 tensors; Q8_0 blocks against
transformers on the dequantized weights)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType as T

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.gguf.header import open_mapped, read_header
from engine.messages import SamplingParams
from engine.models.loader import resolve_model
from tests.engine.gguf.hf_to_gguf import write_gguf
from tests.engine.models.families import build_family
from tests.engine.models.hybrid_families import HYBRIDS, build_hybrid
from tests.helpers.engine import run, tokens

VOCAB = 96
NEW_TOKENS = 8
PROMPTS = [[(7 * i + 3 * j) % (VOCAB - 2) for j in range(20 + 9 * i)] for i in range(2)]  # past OLMo 3's window
OVERRIDES: dict[str, dict[str, Any]] = {  # llama.cpp's SmolLM3: a NoPE layer every 4th, no biases
    "smollm3": dict(tokenizer=False, extra=dict(pad_token_id=0, no_rope_layer_interval=4, attention_bias=False)),
    "olmo2": dict(tokenizer=False, extra=dict(attention_bias=False)),
    "olmo3": dict(tokenizer=False),
    "lfm2": {},
}


@pytest.fixture(autouse=True)
def _one_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.set_num_threads(1)
    monkeypatch.setenv("SPINDLE_CACHE_DIR", str(tmp_path / "cache"))


def _reference(ckpt: Path, prompt: list[int], weights: dict[str, Any] | None) -> list[int]:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    if weights is not None:  # the file's dequantized blocks
        shapes = {k: v.shape for k, v in model.state_dict().items()}  # LFM2's convolution: [channels, 1, kernel]
        model.load_state_dict({k: torch.from_numpy(v).reshape(shapes[k]) for k, v in weights.items()}, strict=False)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),  # token 0 is a prompt token, not padding
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            top_k=None,
            top_p=None,
            temperature=None,
            eos_token_id=None,
            pad_token_id=0,
        )
    return list(out[0, len(prompt) :].tolist())


def _engine(path: Path) -> dict[str, list[int]]:
    core = EngineCore(EngineConfig(model=str(resolve_model(str(path))), dtype="float32", num_blocks=64, block_size=4))
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outs = run(core, [(f"r{i}", p, greedy, 0) for i, p in enumerate(PROMPTS)])
    return {rid: tokens(o) for rid, o in outs.items()}


@pytest.mark.parametrize("qtype", [None, T.F16, T.Q8_0], ids=["f32", "f16", "q8_0"])
@pytest.mark.parametrize("family", list(OVERRIDES))
def test_greedy_equals_transformers(family: str, qtype: T | None, tmp_path: Path) -> None:
    build = build_hybrid if family in HYBRIDS else build_family
    ckpt = build(tmp_path / "hf", family, vocab_size=VOCAB, **OVERRIDES[family])
    path = tmp_path / f"{family}.gguf"
    held = write_gguf(ckpt, path, qtype)
    if qtype == T.Q8_0:  # the projections are blocks: a test of the block kernels, not of F32 passed through
        assert any(t.ggml_type == T.Q8_0 for t in read_header(path, open_mapped(path)).tensors.values())
    folder = resolve_model(str(path))
    derived = json.loads((folder / "config.json").read_text())
    assert derived["architectures"] == json.loads((ckpt / "config.json").read_text())["architectures"]
    got = _engine(path)
    for i, prompt in enumerate(PROMPTS):
        assert got[f"r{i}"] == _reference(ckpt, prompt, held if qtype is not None else None), (family, i)
