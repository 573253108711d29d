"""GGUF files of the 2026 families (SmolLM3, OLMo 2, OLMo 3 filed as olmo2, LFM2; Qwen3.5, Granite 4.0-H, Gemma 4),
written from a random checkpoint as llama.cpp's converter lays them out: config derived from the metadata
(engine/gguf/arch_config.py, engine/gguf/hybrid_config.py), tensors by HF name, and greedy through the engine equal
to transformers on the checkpoint (float32 and F16 tensors; Q8_0 blocks against transformers on the dequantized
weights)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.gguf.header import open_mapped, read_header
from engine.layers import linear
from engine.messages import SamplingParams
from engine.models.checkpoint_meta import ModelLoadError
from engine.models.loader import resolve_model
from tests.engine.gguf.hf_to_gguf import write_gguf
from tests.engine.models.families import FAMILIES, build_family
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


# the checkpoint's Granite expert names -> those transformers 5's model loads them under
_LOADED = {
    ".block_sparse_moe.input_linear.weight": ".block_sparse_moe.experts.gate_up_proj",
    ".block_sparse_moe.output_linear.weight": ".block_sparse_moe.experts.down_proj",
    ".block_sparse_moe.router.layer.weight": ".block_sparse_moe.router.weight",
}


def _loaded_name(name: str) -> str:
    for old, new in _LOADED.items():
        name = name.replace(old, new)
    return name


def _reference(ckpt: Path, prompt: list[int], weights: dict[str, Any] | None) -> list[int]:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    if weights is not None:  # the file's dequantized blocks
        shapes = {k: v.shape for k, v in model.state_dict().items()}  # LFM2's convolution: [channels, 1, kernel]
        loaded = {_loaded_name(k): torch.from_numpy(v) for k, v in weights.items()}
        assert set(loaded) <= set(shapes), sorted(set(loaded) - set(shapes))
        model.load_state_dict({k: v.reshape(shapes[k]) for k, v in loaded.items()}, strict=False)
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


# Qwen3.5, Granite 4.0-H (with experts, and dense) and Gemma 4 as llama.cpp's converter writes them
# (tests/engine/gguf/hf_to_gguf_hybrid.py); llama.cpp's Granite 4.0-H files turn no rope (rope.scaling.finetuned
# false), so the checkpoints have none; Gemma 4's per-layer embedding table sized to the vocabulary
HYBRID_FILES: dict[str, tuple[Callable[..., Path], str, dict[str, Any]]] = {
    "qwen35": (build_hybrid, "qwen3_5", {}),
    "granitehybrid": (build_hybrid, "granite_h", dict(position_embedding_type=None)),
    "granitehybrid-dense": (build_hybrid, "granite_h_dense", {}),
    "gemma4": (
        build_family,
        "gemma4",
        dict(tokenizer=False, extra=dict(FAMILIES["gemma4"]["extra"], vocab_size_per_layer_input=VOCAB)),
    ),
}


# K-quant blocks need rows of 256 weights: the same checkpoints 256 wide
WIDE = dict(hidden_size=256)
HYBRID_FILES |= {
    "qwen35-wide": (build_hybrid, "qwen3_5", WIDE),
    "gemma4-wide": (build_family, "gemma4", dict(HYBRID_FILES["gemma4"][2], **WIDE)),
}
HYBRID_CASES = [(n, q) for n in HYBRID_FILES if not n.endswith("-wide") for q in (None, T.Q8_0)] + [
    ("qwen35-wide", T.Q4_K),
    ("gemma4-wide", T.Q6_K),
]


@pytest.mark.parametrize(
    ("name", "qtype"), HYBRID_CASES, ids=[f"{n}-{q.name.lower() if q else 'f32'}" for n, q in HYBRID_CASES]
)
def test_hybrid_greedy_equals_transformers(
    name: str, qtype: T | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy through the engine equals transformers on what the file holds (the checkpoint's weights after the
    converter's transforms and back: Qwen3.5's +1 norms and A = -exp(A_log) round in float32); Q8_0 projections
    stay the file's blocks on CPU."""
    build, family, overrides = HYBRID_FILES[name]
    ckpt = build(tmp_path / "hf", family, vocab_size=VOCAB, **overrides)
    path = tmp_path / f"{name}.gguf"
    held = write_gguf(ckpt, path, qtype)
    header = read_header(path, open_mapped(path))
    assert header.architecture == name.split("-")[0]
    folder = resolve_model(str(path))
    derived = json.loads((folder / "config.json").read_text())
    assert derived["architectures"] == json.loads((ckpt / "config.json").read_text())["architectures"]
    made: list[Any] = []  # the weights the quantized linears were made from (GGUF blocks kept on CPU)
    maker = linear.QUANTIZED_MAKERS[-1]

    def counting(weight: Any, bias: torch.Tensor | None) -> Any:
        made.append(weight)
        return maker(weight, bias)

    monkeypatch.setattr(linear, "QUANTIZED_MAKERS", [counting])
    got = _engine(path)
    if qtype is not None:
        assert sum(t.ggml_type == qtype for t in header.tensors.values()) >= 4
        assert sum(getattr(w, "ggml_type", None) == qtype for w in made) >= 4, made
    for i, prompt in enumerate(PROMPTS):
        assert got[f"r{i}"] == _reference(ckpt, prompt, held), (name, i)


@pytest.mark.parametrize(
    ("name", "extra", "named"),
    [
        ("gemma4", {"gemma4.expert_count": 4}, "gemma4.expert_count"),
        ("qwen35", {"qwen35.rope.scaling.type": "yarn"}, "qwen35.rope.scaling.type"),
        ("granitehybrid", {"granitehybrid.rope.dimension_count": 8}, "granitehybrid.rope.dimension_count"),
    ],
)
def test_hybrid_unserved_key_refused(name: str, extra: dict[str, Any], named: str, tmp_path: Path) -> None:
    build, family, overrides = HYBRID_FILES[name]
    ckpt = build(tmp_path / "hf", family, vocab_size=VOCAB, **overrides)
    plain, path = tmp_path / "plain.gguf", tmp_path / f"{name}.gguf"
    write_gguf(ckpt, plain)
    _rewrite(plain, path, extra, {})
    with pytest.raises(ModelLoadError) as e:
        resolve_model(str(path))
    assert named in str(e.value) and "\n" not in str(e.value)


def test_hybrid_unserved_tensor_refused(tmp_path: Path) -> None:
    build, family, overrides = HYBRID_FILES["qwen35"]
    ckpt = build(tmp_path / "hf", family, vocab_size=VOCAB, **overrides)
    plain, path = tmp_path / "plain.gguf", tmp_path / "qwen35.gguf"
    write_gguf(ckpt, plain)
    _rewrite(plain, path, {}, {"blk.3.attn_q.bias": np.zeros(128, dtype=np.float32)})
    with pytest.raises(ModelLoadError, match="tensor 'blk.3.attn_q.bias' is not served"):
        resolve_model(str(path))


def _rewrite(src: Path, dst: Path, keys: dict[str, Any], tensors: dict[str, np.ndarray]) -> None:
    """The file again with keys set (or replaced) and tensors added."""
    reader = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), str(reader.fields["general.architecture"].contents()))
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture" or field.name in keys:
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    for key, value in keys.items():
        w.add_key_value(key, value, gguf.GGUFValueType.STRING if isinstance(value, str) else gguf.GGUFValueType.UINT32)
    for t in reader.tensors:
        w.add_tensor(
            t.name, np.array(t.data), raw_shape=tuple(reversed([int(d) for d in t.shape])), raw_dtype=t.tensor_type
        )
    for name, value in tensors.items():
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_qwen35_file_as_transformers_reads_it(tmp_path: Path) -> None:
    """The test's writer and its inverse agree with transformers' own GGUF reader of qwen35 files, bit for bit (an
    independent reading of llama.cpp's layout: the V-head order, A = -exp(A_log), the +1 norms)."""
    from transformers import AutoModelForCausalLM

    build, family, overrides = HYBRID_FILES["qwen35"]
    ckpt = build(tmp_path / "hf", family, vocab_size=VOCAB, **overrides)
    path = tmp_path / "gguf" / "qwen35.gguf"
    path.parent.mkdir()
    held = write_gguf(ckpt, path)
    model: Any = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    state = model.state_dict()
    assert set(state) == set(held)
    for name, value in held.items():
        assert torch.equal(torch.from_numpy(value).reshape(state[name].shape), state[name]), name
