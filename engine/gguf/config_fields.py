"""The config.json fields every decoder-only GGUF file states, from llama.cpp's keys (`{arch}.block_count`, ...)."""

from __future__ import annotations

from typing import Any

from engine.gguf.source import GGUFModel


def common(model: GGUFModel) -> dict[str, Any]:
    """The fields every decoder-only file states, under transformers' names."""
    meta, arch = model.metadata, model.architecture
    heads = int(meta[f"{arch}.attention.head_count"])
    kv: Any = meta.get(f"{arch}.attention.head_count_kv", heads)
    kv = max(int(k) for k in kv) if hasattr(kv, "__len__") else int(kv)  # per layer (0: no attention) in hybrids
    hidden = int(meta[f"{arch}.embedding_length"])
    ffn: Any = meta[f"{arch}.feed_forward_length"]  # per layer in Gemma 4 (its KV-sharing layers may be wider)
    tokens = meta.get("tokenizer.ggml.tokens") or []
    cfg: dict[str, Any] = {
        "hidden_size": hidden,
        "num_hidden_layers": int(meta[f"{arch}.block_count"]),
        "intermediate_size": int(ffn[0]) if hasattr(ffn, "__len__") else int(ffn),
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": int(meta.get(f"{arch}.attention.key_length", hidden // heads)),
        "max_position_embeddings": int(meta.get(f"{arch}.context_length", 4096)),
        "rms_norm_eps": float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "vocab_size": int(meta.get(f"{arch}.vocab_size", len(tokens))),
        "tie_word_embeddings": "output.weight" not in model.tensors(),
    }
    for key in ("bos_token_id", "eos_token_id", "padding_token_id"):
        if (value := meta.get(f"tokenizer.ggml.{key}")) is not None:
            cfg[key.replace("padding", "pad")] = int(value)
    return cfg


def rope_scaling(model: GGUFModel) -> dict[str, Any] | None:
    meta, arch = model.metadata, model.architecture
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    scaling: dict[str, Any] = {"rope_type": str(kind), "factor": float(meta[f"{arch}.rope.scaling.factor"])}
    if (original := meta.get(f"{arch}.rope.scaling.original_context_length")) is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling
