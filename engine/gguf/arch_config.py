"""config.json from GGUF metadata for the architectures transformers' GGUF reader lacks or reads short (SmolLM3,
OLMo 2 / 3, LFM2; Qwen3.5, Granite 4.0-H and Gemma 4 in engine/gguf/hybrid_config.py).

Keys are llama.cpp's (`{arch}.block_count`, `{arch}.attention.sliding_window_pattern`, ...), as its converter
writes them; what llama.cpp fixes in code rather than the file (SmolLM3's NoPE layer every 4th) is fixed here too.
"""

from __future__ import annotations

from typing import Any

from engine.gguf.config_fields import common as _common
from engine.gguf.config_fields import rope_scaling as _rope_scaling
from engine.gguf.hybrid_config import HYBRID
from engine.gguf.source import GGUFModel


def _smollm3(model: GGUFModel) -> dict[str, Any]:
    # llama.cpp's SmolLM3 has no key for it: a NoPE layer every 4th (n_no_rope_layer_step), HF's default as well
    return _common(model) | {
        "model_type": "smollm3",
        "no_rope_layer_interval": 4,
        "architectures": ["SmolLM3ForCausalLM"],
    }


def _olmo2(model: GGUFModel) -> dict[str, Any]:
    """OLMo 2, or OLMo 3 (filed as olmo2) where the file states a sliding window and its per-layer pattern."""
    meta, arch = model.metadata, model.architecture
    cfg = _common(model) | {"model_type": "olmo2", "architectures": ["Olmo2ForCausalLM"]}
    cfg["attention_bias"] = "blk.0.attn_q.bias" in model.tensors()
    if (scaling := _rope_scaling(model)) is not None:
        cfg["rope_scaling"] = scaling
    window = meta.get(f"{arch}.attention.sliding_window")
    if window:
        n = cfg["num_hidden_layers"]
        stated: Any = meta.get(f"{arch}.attention.sliding_window_pattern")
        pattern = [bool(p) for p in stated] if hasattr(stated, "__len__") and len(stated) == n else []
        if not pattern:  # a period (or nothing: llama.cpp's OLMo 3 default of 4): every period-th layer is full
            period = int(stated) if isinstance(stated, (int, float)) and stated else 4
            pattern = [(i + 1) % period != 0 for i in range(n)]
        cfg |= {"model_type": "olmo3", "architectures": ["Olmo3ForCausalLM"], "sliding_window": int(window)}
        cfg["layer_types"] = ["sliding_attention" if bool(p) else "full_attention" for p in pattern]
    return cfg


def _lfm2(model: GGUFModel) -> dict[str, Any]:
    """LFM2: the layers whose KV head count is 0 are short convolutions; the file's FFN width is the adjusted one."""
    meta, arch = model.metadata, model.architecture
    cfg = _common(model)
    per_layer: Any = meta[f"{arch}.attention.head_count_kv"]
    kinds = ["full_attention" if int(k) else "conv" for k in per_layer] if hasattr(per_layer, "__len__") else None
    cfg |= {
        "model_type": "lfm2",
        "architectures": ["Lfm2ForCausalLM"],
        "layer_types": kinds or ["full_attention"] * cfg["num_hidden_layers"],
        "conv_L_cache": int(meta[f"{arch}.shortconv.l_cache"]),
        "conv_bias": any(name.endswith("shortconv.conv.bias") for name in model.tensors()),
        "norm_eps": cfg["rms_norm_eps"],
        "block_ff_dim": cfg["intermediate_size"],
        "block_auto_adjust_ff_dim": False,
    }
    return cfg


# GGUF architecture -> its config.json, for those transformers' GGUF reader does not know or reads short
DERIVED = {"smollm3": _smollm3, "olmo2": _olmo2, "lfm2": _lfm2, **HYBRID}


def derived_config(model: GGUFModel) -> dict[str, Any] | None:
    """config.json for the file, or None where transformers' reader serves its architecture."""
    build = DERIVED.get(model.architecture)
    return None if build is None else build(model)
