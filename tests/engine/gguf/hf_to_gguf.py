"""A tiny Hugging Face checkpoint written as llama.cpp's converter (convert_hf_to_gguf.py) lays it out: its metadata
keys, gguf's tensor names, llama's Q/K rows permuted for its rotary layout, 2-D weights optionally quantized."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from safetensors.numpy import load_file

from tests.engine.gguf import hf_to_gguf_hybrid as hybrid
from tests.engine.gguf.files import TOKENS, write_tensors

# HF model_type -> (GGUF architecture, whether llama.cpp permutes Q/K rows for it)
GGUF_ARCH = {
    "smollm3": ("smollm3", True),
    "olmo2": ("olmo2", False),
    "olmo3": ("olmo2", False),
    "lfm2": ("lfm2", False),
}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _metadata(w: gguf.GGUFWriter, cfg: dict[str, Any]) -> None:
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    kv = cfg["num_key_value_heads"]
    if cfg["model_type"] == "lfm2":  # LFM2Model: KV heads per layer, 0 on the convolutions
        kv = [kv if t == "full_attention" else 0 for t in cfg["layer_types"]]
        w.add_shortconv_l_cache(cfg["conv_L_cache"])
    w.add_head_count_kv(kv)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.get("rms_norm_eps") or cfg["norm_eps"])
    rope = cfg.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)  # OLMo 3: one per layer type; llama.cpp writes the full layers'
    w.add_rope_freq_base(float(rope.get("rope_theta") or cfg.get("rope_theta")))
    scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if scaling and scaling.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(scaling["factor"])
        w.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
    if cfg.get("sliding_window") and cfg.get("layer_types"):  # OLMo 3, as Olmo2Model writes it
        w.add_sliding_window(cfg["sliding_window"])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
    w.add_vocab_size(cfg["vocab_size"])


def _tokenizer(w: gguf.GGUFWriter, vocab: int) -> None:
    tokens = TOKENS[: vocab - 2] + TOKENS[-2:]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * (vocab - 2) + [3, 3])
    w.add_token_merges(["a b"])
    w.add_bos_token_id(vocab - 2)
    w.add_eos_token_id(vocab - 1)


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(ckpt: Path) -> dict[str, tuple[str, np.ndarray, int]]:
    """GGUF name -> (HF name, the tensor as llama.cpp's converter writes it (float32), the heads its rows were
    permuted over or 0)."""
    cfg = json.loads((ckpt / "config.json").read_text())
    arch, permuted = GGUF_ARCH[cfg["model_type"]]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg["num_hidden_layers"])
    out: dict[str, tuple[str, np.ndarray, int]] = {}
    for name, value in load_file(str(ckpt / "model.safetensors")).items():
        stem, _, suffix = name.rpartition(".")
        mapped = names.get_name(stem)
        assert mapped is not None, name
        value, heads = value.astype(np.float32), 0
        if mapped.endswith("shortconv.conv") and suffix == "weight":
            value = value.squeeze(1)  # LFM2Model: the convolution as [channels, kernel]
        if permuted and mapped.endswith(("attn_q", "attn_k")) and suffix == "weight":
            heads = cfg["num_attention_heads"] if mapped.endswith("attn_q") else cfg["num_key_value_heads"]
            value = _permute(value, heads)
        out[f"{mapped}.{suffix}"] = (name, value, heads)
    return out


def _quantizable(name: str, value: np.ndarray, qtype: gguf.GGMLQuantizationType | None) -> bool:
    """What llama.cpp quantizes: weights of 2+ dimensions, not norms or the SSM convolution, whole blocks a row."""
    if qtype is None or value.ndim < 2 or value.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
        return False
    return name.endswith(".weight") and "norm" not in name and "conv1d" not in name


def _write(
    path: Path,
    arch: str,
    meta: Callable[[gguf.GGUFWriter], None],
    vocab: int,
    tensors: dict[str, np.ndarray],
    qtype: Any,
) -> dict[str, np.ndarray]:
    """Writes the file; returns what it holds by GGUF name (float32, quantized tensors dequantized back)."""
    w = gguf.GGUFWriter(str(path), arch)
    meta(w)
    _tokenizer(w, vocab)
    return write_tensors(w, tensors, qtype, lambda name, value: _quantizable(name, value, qtype))


def _write_hybrid(ckpt: Path, path: Path, qtype: Any) -> dict[str, np.ndarray]:
    """Qwen3.5, Granite 4.0-H, Gemma 4 (tests/engine/gguf/hf_to_gguf_hybrid.py): the file's tensors in HF's layout,
    the inverse first checked against the checkpoint."""
    cfg = json.loads((ckpt / "config.json").read_text())
    hf = load_file(str(ckpt / "model.safetensors"))
    arch, meta, tensors = hybrid.convert(cfg, hf)
    for name, value in hybrid.back(cfg, tensors, hf).items():
        assert np.allclose(value.reshape(hf[name].shape), hf[name], rtol=1e-5, atol=1e-6), name
    return hybrid.back(cfg, _write(path, arch, meta, cfg["vocab_size"], tensors, qtype), hf)


def write_gguf(ckpt: Path, path: Path, qtype: gguf.GGMLQuantizationType | None = None) -> dict[str, np.ndarray]:
    """Writes the checkpoint as a GGUF file; returns what the file holds by HF name, in HF's layout (float32,
    quantized tensors dequantized back): the weights a reference model loads."""
    cfg = json.loads((ckpt / "config.json").read_text())
    if cfg["model_type"] in hybrid.KINDS:
        return _write_hybrid(ckpt, path, qtype)
    converted = gguf_tensors(ckpt)
    tensors = {name: value for name, (_, value, _) in converted.items()}
    arch = GGUF_ARCH[cfg["model_type"]][0]
    stored = _write(path, arch, lambda w: _metadata(w, cfg), cfg["vocab_size"], tensors, qtype)
    return {hf: _unpermute(stored[n], heads) if heads else stored[n] for n, (hf, _, heads) in converted.items()}
