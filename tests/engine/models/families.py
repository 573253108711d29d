"""Tiny random checkpoints of each family (transformers' own classes, saved with save_pretrained).

Each has what makes its family differ, at a size where it shows: Qwen3's head_dim apart from hidden / heads;
Qwen3-MoE with 8 experts, top-2, one dense layer (mlp_only_layers); Mixtral's w1/w2/w3 experts; Gemma 2's
alternating windows of 8, soft-caps small enough to bite and query_pre_attn_scalar apart from head_dim;
Gemma 3 with a local rope base and linear scaling on its global layer; Phi-3 with longrope past 32 positions
and partial rotary; SmolLM3 with a NoPE layer every second one; OLMo 2 with biases, OLMo 3 with windows on
every other layer and yarn on its full ones. Prompts in the tests run past the windows and the original rope length.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

BASE: dict[str, Any] = dict(
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=128,
    max_position_embeddings=1024,
    seed=2026,
)
ORIGINAL_ROPE_LENGTH = 32
WINDOW = 8
QWEN_VOCAB = 151_646
LONGROPE = {
    "rope_type": "longrope",
    "original_max_position_embeddings": ORIGINAL_ROPE_LENGTH,
    "short_factor": [1.0 + 0.1 * i for i in range(4)],
    "long_factor": [1.0 + 1.5 * i for i in range(4)],
}
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3": dict(
        head_dim=32,
        vocab_size=QWEN_VOCAB,
        tie_word_embeddings=True,
        rope_theta=1_000_000.0,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL_ROPE_LENGTH},
    ),
    "qwen3_moe": dict(
        vocab_size=QWEN_VOCAB,
        tie_word_embeddings=False,
        rope_theta=1_000_000.0,
        extra=dict(
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1]
        ),
    ),
    "mixtral": dict(
        vocab_size=32_000,
        tie_word_embeddings=False,
        rope_theta=1_000_000.0,
        extra=dict(num_local_experts=4, num_experts_per_tok=2),
    ),
    "gemma2": dict(
        vocab_size=QWEN_VOCAB,
        tie_word_embeddings=True,
        rope_theta=10_000.0,
        sliding_window=WINDOW,
        extra=dict(attn_logit_softcapping=3.0, final_logit_softcapping=5.0, query_pre_attn_scalar=24),
    ),
    "gemma3": dict(
        vocab_size=QWEN_VOCAB,
        tie_word_embeddings=True,
        rope_theta=1_000_000.0,
        sliding_window=WINDOW,
        rope_scaling={"rope_type": "linear", "factor": 4.0},
        extra=dict(
            query_pre_attn_scalar=24, layer_types=["sliding_attention", "full_attention"], rope_local_base_freq=100.0
        ),
    ),
    "smollm3": dict(
        vocab_size=QWEN_VOCAB,
        tie_word_embeddings=True,
        rope_theta=2_000_000.0,
        num_layers=4,
        extra=dict(no_rope_layer_interval=2, attention_bias=True),
    ),
    "olmo2": dict(
        vocab_size=QWEN_VOCAB, tie_word_embeddings=False, rope_theta=500_000.0, extra=dict(attention_bias=True)
    ),
    "olmo3": dict(
        vocab_size=QWEN_VOCAB,
        tie_word_embeddings=False,
        rope_theta=500_000.0,
        num_layers=4,
        sliding_window=WINDOW,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL_ROPE_LENGTH},
        extra=dict(layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"]),
    ),
    "gemma4": dict(
        vocab_size=QWEN_VOCAB,
        tie_word_embeddings=True,
        rope_theta=10_000.0,
        num_layers=6,
        sliding_window=WINDOW,
        extra=dict(
            layer_types=["sliding_attention", "full_attention"] * 3,
            global_head_dim=32,
            attention_k_eq_v=True,
            num_global_key_value_heads=1,
            num_kv_shared_layers=2,
            hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=QWEN_VOCAB,
            use_double_wide_mlp=True,
            final_logit_softcapping=5.0,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 1e6},
            },
        ),
    ),
    "phi3": dict(
        vocab_size=32_000,
        tie_word_embeddings=False,
        rope_theta=10_000.0,
        rope_scaling=LONGROPE,
        extra=dict(partial_rotary_factor=0.5, original_max_position_embeddings=ORIGINAL_ROPE_LENGTH),
    ),
}


def build_family(root: Path, arch: str, **overrides: Any) -> Path:
    from demo.checkpoints import write_random_checkpoint

    kw = dict(BASE, **FAMILIES[arch])
    kw.update(overrides)
    name = arch + "".join(f"-{k}{v}" for k, v in sorted(overrides.items()))
    if len(name) > 80:  # a dict override (rope_scaling) spells out too long a folder name
        name = f"{arch}-{hashlib.sha256(name.encode()).hexdigest()[:16]}"
    return write_random_checkpoint(root / name, arch, **kw)  # type: ignore[arg-type]
