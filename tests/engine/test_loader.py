"""Loading checkpoints: single file and sharded agree, and every broken folder says what is wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from demo.checkpoints import write_random_checkpoint
from engine.config import EngineConfig
from engine.cpu_kernels import gemm
from engine.layers.linear import Int8Linear
from engine.models.loader import load_model, pick_dtype, resolve_model, slow_half_precision
from engine.models.weights import ModelLoadError

SMALL = dict(
    hidden_size=32,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    intermediate_size=64,
    vocab_size=1000,
    rope_theta=10_000.0,
    max_position_embeddings=128,
    seed=7,
    tokenizer=False,
)


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(
        tmp_path_factory.mktemp("small") / "ckpt", "llama", tie_word_embeddings=False, **SMALL
    )  # type: ignore[arg-type]


def broken_copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "broken"
    shutil.copytree(src, dst)
    return dst


def all_weights(model) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    assert model.head.transposed is not None  # float32 on CPU: stored [hidden, vocab]
    tensors = [model.embed, model.norm, model.head.transposed]
    assert model.embed is not None  # untied checkpoints keep their embedding table
    for layer in model.layers:
        tensors += [layer.ln1, layer.ln2]
        for lin in (layer.qkv, layer.o, layer.mlp.gate_up, layer.mlp.down):
            tensors += [t for t in (lin.dense_weight(), lin.bias) if t is not None]
    return tensors


def test_sharded_equals_single_file(small: Path, tmp_path: Path) -> None:
    sharded = write_random_checkpoint(tmp_path / "sharded", "llama", tie_word_embeddings=False, shards=3, **SMALL)  # type: ignore[arg-type]
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3
    one, info_one = load_model(small, "auto", "cpu")
    many, info_many = load_model(sharded, "auto", "cpu")
    assert info_one == info_many
    for a, b in zip(all_weights(one), all_weights(many), strict=True):
        assert torch.equal(a, b)
    # And both equal the tensors as stored, so the comparison is not of two empty models.
    stored = load_file(small / "model.safetensors")
    assert one.head.transposed is not None and torch.equal(one.head.transposed, stored["lm_head.weight"].t())
    assert one.embed is not None and torch.equal(one.embed, stored["model.embed_tokens.weight"])
    assert torch.equal(one.layers[1].mlp.down.dense_weight(), stored["model.layers.1.mlp.down_proj.weight"])


def test_info_from_generation_config(qwen2_ckpt: Path) -> None:
    _, info = load_model(qwen2_ckpt, "auto", "cpu")
    assert info.eos_token_ids == [151645, 151643]
    assert info.generation_defaults == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    assert (info.vocab_size, info.num_layers, info.num_kv_heads, info.head_dim) == (151_646, 2, 2, 16)
    assert info.dtype == "float32"


def test_eos_falls_back_to_config_json(small: Path, tmp_path: Path) -> None:
    folder = broken_copy(small, tmp_path)
    (folder / "generation_config.json").unlink()
    _, info = load_model(folder, "auto", "cpu")
    assert info.eos_token_ids == [2] and info.generation_defaults == {}


def test_explicit_dtype(small: Path) -> None:
    model, info = load_model(small, "bfloat16", "cpu")
    assert info.dtype == "bfloat16" and model.layers[0].qkv.dense_weight().dtype == torch.bfloat16


def test_int8_quantization_is_cpu_only_and_validated(small: Path) -> None:
    model, _ = load_model(small, "bfloat16", "cpu", quantization="int8")
    assert model.layers[0].mlp.down.dense_weight().dtype == torch.bfloat16
    assert all(isinstance(lin, Int8Linear) for _, _, lin in model.head.chunks)  # the LM head too
    with pytest.raises(ModelLoadError, match="CPU only"):
        load_model(small, "bfloat16", "cuda", quantization="int8")  # refused before any weight is read
    with pytest.raises(ValueError, match="int8"):
        EngineConfig(model=str(small), quantization="int4")


def test_auto_dtype_is_the_fastest_that_runs_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """auto: a bf16 checkpoint in bf16 where the bf16 kernels built and passed their self-check (else float32);
    the checkpoint's dtype on GPU; float32 whenever asked."""
    folder = write_random_checkpoint(tmp_path / "bf16", "llama", tie_word_embeddings=False, dtype="bfloat16", **SMALL)  # type: ignore[arg-type]
    model, info = load_model(folder, "auto", "cpu")
    stored = load_file(folder / "model.safetensors")["model.norm.weight"]
    assert info.dtype == ("bfloat16" if gemm.available() else "float32") and stored.dtype == torch.bfloat16
    model, info = load_model(folder, "float32", "cpu")
    assert info.dtype == "float32" and torch.equal(model.norm, stored.float())
    monkeypatch.setattr(gemm, "available", lambda: False)  # no bf16 kernel here: float32
    assert pick_dtype("auto", "bfloat16", torch.device("cpu")) == "float32"
    assert pick_dtype("auto", "float32", torch.device("cpu")) == "float32"
    assert pick_dtype("auto", "bfloat16", torch.device("cuda")) == "bfloat16"
    assert pick_dtype("auto", None, torch.device("cuda")) == "float32"
    with pytest.raises(ModelLoadError, match="float64"):
        pick_dtype("float64", None, torch.device("cpu"))


def test_missing_config(small: Path, tmp_path: Path) -> None:
    folder = broken_copy(small, tmp_path)
    (folder / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(folder, "auto", "cpu")


def test_no_safetensors(small: Path, tmp_path: Path) -> None:
    folder = broken_copy(small, tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        load_model(folder, "auto", "cpu")


def test_missing_weight_is_named(small: Path, tmp_path: Path) -> None:
    folder = broken_copy(small, tmp_path)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.self_attn.v_proj.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.self_attn\.v_proj\.weight"):
        load_model(folder, "auto", "cpu")


def test_missing_shard_is_named(tmp_path: Path) -> None:
    folder = write_random_checkpoint(tmp_path / "sharded", "llama", tie_word_embeddings=False, shards=2, **SMALL)  # type: ignore[arg-type]
    shard = sorted(folder.glob("*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=shard.name):
        load_model(folder, "auto", "cpu")


def test_unsupported_architecture(small: Path, tmp_path: Path) -> None:
    folder = broken_copy(small, tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ModelLoadError,
        match=r"architecture GPT2LMHeadModel is not supported; supported: LlamaForCausalLM, .*Gemma2ForCausalLM",
    ):
        load_model(folder, "auto", "cpu")


def test_local_folder_resolves_to_itself(small: Path) -> None:
    assert resolve_model(str(small)) == small


def test_missing_local_folder(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no such folder"):
        resolve_model(str(tmp_path / "nowhere"))


def test_unreachable_hub_id() -> None:
    # Offline here; online the id does not exist: either way the user is told to pass a folder.
    with pytest.raises(ModelLoadError, match="(?s)could not be downloaded.*local checkpoint folder"):
        resolve_model("no-such-org/no-such-model")


def test_demo_checkpoint_built_once_and_loads(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from demo.checkpoints import demo_checkpoint_path

    monkeypatch.setenv("SPINDLE_CACHE_DIR", str(tmp_path))
    path = demo_checkpoint_path()
    assert path == tmp_path / "demo-qwen2.5-v2"
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert demo_checkpoint_path() == path and (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == ["demo-qwen2.5-v2"]  # no temporary folder left behind
    model, info = load_model(path, "auto", "cpu")
    # the embedding is padded to 151,936 rows as Qwen2.5's is; the engine samples only the tokenizer's 151,665
    assert (info.vocab_size, info.num_layers, info.num_kv_heads, info.head_dim) == (151_665, 2, 2, 64)
    assert json.loads((path / "config.json").read_text())["vocab_size"] == 151_936
    ids = torch.tensor([0, 7, 151_645, 151_935])
    stored = load_file(path / "model.safetensors")
    assert "lm_head.weight" not in stored and model.tied  # tied: one table serves both ends
    assert torch.equal(model.embed_tokens(ids), stored["model.embed_tokens.weight"][ids])
    tok = AutoTokenizer.from_pretrained(path)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert isinstance(text, str) and text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert len(tok) == info.vocab_size
    assert tok.convert_ids_to_tokens([151652, 151655, 151656, 151657, 151658, 151664]) == [
        "<|vision_start|>",
        "<|image_pad|>",
        "<|video_pad|>",
        "<tool_call>",
        "</tool_call>",
        "<|file_sep|>",
    ]
    assert tok.decode([151657, 151658, 151645], skip_special_tokens=True) == "<tool_call></tool_call>"
    tools: list[Any] = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    calls: list[Any] = [
        {
            "role": "assistant",
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
    ]
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}, *calls], tools=tools, tokenize=False, add_generation_prompt=True
    )
    assert "<tools>\n" + json.dumps(tools[0]) + "\n</tools>" in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n" in text


def test_concurrent_demo_builders_agree(tmp_path: Path) -> None:
    """Two processes building the demo at once both get the one complete folder (a small stand-in demo)."""
    import os
    import subprocess
    import sys

    code = (
        "import demo.checkpoints as c; c.DEMO = dict(c.DEMO, hidden_size=32, head_dim=16, vocab_size=1000, "
        "intermediate_size=64, tokenizer=False); print(c.demo_checkpoint_path())"
    )
    env = dict(os.environ, SPINDLE_CACHE_DIR=str(tmp_path), OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True) for _ in range(2)
    ]
    outs = [p.communicate(timeout=120)[0].strip().splitlines()[-1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs == [str(tmp_path / "demo-qwen2.5-v2")] * 2
    assert [p.name for p in tmp_path.iterdir()] == ["demo-qwen2.5-v2"]  # the loser's temporary folder is gone
    load_model(tmp_path / "demo-qwen2.5-v2", "auto", "cpu")


def test_half_precision_on_a_cpu_without_native_support_is_called_slow(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported", "_is_amx_fp16_supported"):
        monkeypatch.setattr(torch.cpu, name, lambda: False)
    why = slow_half_precision("bfloat16", cpu)
    assert why is not None and "--dtype float32" in why
    assert slow_half_precision("float16", cpu) is not None
    assert slow_half_precision("float32", cpu) is None
    assert slow_half_precision("bfloat16", torch.device("cuda")) is None  # GPUs have it
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)  # e.g. Sapphire Rapids, Zen 4
    assert slow_half_precision("bfloat16", cpu) is None
