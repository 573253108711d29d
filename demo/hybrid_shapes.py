"""The hybrid models' shapes for `spindle make-demo --shape` (demo/shapes.py): Qwen3.5-0.8B (Gated DeltaNet and
gated full attention, 3:1) and LFM2-1.2B (short convolutions and GQA), their published config.json less the
transformers version.

Their tensor names and shapes come from transformers' own class built on the meta device (no memory, no time), so
the file holds every tensor the real checkpoint holds (A_log, dt_bias, conv1d, the gated norm...).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

_QWEN35_LAYERS = 24
HYBRID_SHAPES: dict[str, dict[str, Any]] = {
    # Qwen/Qwen3.5-0.8B's text_config (the text-only causal LM of the vision-language checkpoint)
    "qwen3.5-0.8b": {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "hidden_act": "silu",
        "hidden_size": 1024,
        "intermediate_size": 3584,
        "num_hidden_layers": _QWEN35_LAYERS,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(_QWEN35_LAYERS)],
        "full_attention_interval": 4,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 16,
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
            "mrope_interleaved": True,
            "mrope_section": [11, 11, 10],
        },
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": True,
        "vocab_size": 248320,
        "bos_token_id": None,
        "eos_token_id": 248044,
        "initializer_range": 0.02,
        "torch_dtype": "bfloat16",
        "use_cache": True,
    },
    # LiquidAI/LFM2-1.2B: block_ff_dim 12288 auto-adjusted to 8192 (2/3, multiple of 256), conv layers but 6
    "lfm2-1.2b": {
        "architectures": ["Lfm2ForCausalLM"],
        "model_type": "lfm2",
        "hidden_size": 2048,
        "intermediate_size": 12288,
        "block_auto_adjust_ff_dim": True,
        "block_ffn_dim_multiplier": 1.0,
        "block_multiple_of": 256,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "layer_types": ["full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv" for i in range(16)],
        "conv_L_cache": 3,
        "conv_bias": False,
        "max_position_embeddings": 128000,
        "norm_eps": 1e-05,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
        "tie_word_embeddings": True,
        "vocab_size": 65536,
        "bos_token_id": 1,
        "eos_token_id": 7,
        "pad_token_id": 0,
        "initializer_range": 0.02,
        "torch_dtype": "bfloat16",
        "use_cache": True,
    },
}
HYBRID_GENERATION: dict[str, dict[str, Any]] = {
    "qwen3_5_text": {"eos_token_id": [248046, 248044], "pad_token_id": 248044, "do_sample": True, "temperature": 0.6},
    "lfm2": {"bos_token_id": 1, "eos_token_id": 7, "pad_token_id": 0, "do_sample": True, "temperature": 0.3},
}
_CLASSES = {"qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"), "lfm2": ("Lfm2Config", "Lfm2ForCausalLM")}


def hybrid_tensor_shapes(cfg: dict[str, Any]) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every tensor the family's transformers class saves for this config (a tied LM head left out)."""
    import transformers  # why late: only the hybrid shapes need it

    config_name, model_name = _CLASSES[cfg["model_type"]]
    fields = {k: v for k, v in cfg.items() if k not in ("model_type", "torch_dtype")}
    config = getattr(transformers, config_name)(**fields)
    with torch.device("meta"):
        model = getattr(transformers, model_name)(config)
    for name, p in model.named_parameters():  # a tied head shares the embedding's parameter: listed once
        if not (name == "lm_head.weight" and cfg.get("tie_word_embeddings")):
            yield name, tuple(p.shape)
