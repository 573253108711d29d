"""OLMo 2 and OLMo 3 on the plain decoder.

Both: no norm before a sub-block, a norm closing each (post_attention_layernorm, post_feedforward_layernorm)
before the residual add, norm weights multiplying in float32 (the product rounded once); q and k each normed
over all heads at once, before rope; no rope layers apart. OLMo 3 windows three layers in four (`layer_types`,
`sliding_window`) and turns its windowed layers with plain rope: rope scaling applies to the full layers only.
"""

from __future__ import annotations

from typing import Any

from engine.models.args import (
    ConfigError,
    ModelArgs,
    arch_of,
    attention_bias_fields,
    common_fields,
    layer_windows,
    rope_fields,
    rope_settings,
    window_fields,
)

OLMO_ROPE = ("linear", "llama3", "yarn")


def _olmo_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    return dict(
        common_fields(cfg),
        **attention_bias_fields(cfg),
        mlp_bias=False,
        qk_norm=True,
        qk_norm_across_heads=True,
        olmo_norms=True,
    )


def parse_olmo2(cfg: dict[str, Any], arch: str) -> ModelArgs:
    rope = rope_fields(cfg, OLMO_ROPE, default_theta=10_000.0)  # Olmo2Config's default
    n = int(cfg["num_hidden_layers"])
    return ModelArgs(architecture=arch, **rope, **_olmo_fields(cfg), **window_fields((None,) * n))


def parse_olmo3(cfg: dict[str, Any], arch: str) -> ModelArgs:
    n = int(cfg["num_hidden_layers"])
    default = ["sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(n)]
    cfg = dict(cfg, sliding_window=cfg.get("sliding_window", 4096))  # transformers' default when absent
    windows = layer_windows(cfg, default)
    nested = cfg.get("rope_parameters") or {}
    if "full_attention" in nested or "sliding_attention" in nested:  # transformers 5: one dict per layer type
        full = dict(nested.get("full_attention") or {})
        local = dict(nested.get("sliding_attention") or {})
    else:  # older configs: rope_theta for both, rope_scaling for the full layers only
        full = dict(cfg.get("rope_scaling") or {}, rope_theta=cfg.get("rope_theta") or 500_000.0)
        local = {"rope_theta": cfg.get("rope_theta") or 500_000.0}
    if local.get("rope_type", "default") != "default":
        raise ConfigError(
            f"{arch_of(cfg)} with rope_parameters.sliding_attention.rope_type {local['rope_type']!r} is not "
            "supported; only default"
        )
    positions = cfg.get("max_position_embeddings")
    theta, scaling = rope_settings(
        {"rope_parameters": full, "architectures": [arch], "max_position_embeddings": positions},
        OLMO_ROPE,
        default_theta=500_000.0,  # Olmo3Config's default
    )
    any_window = any(w is not None for w in windows)
    return ModelArgs(
        architecture=arch,
        rope_theta=float(full.get("rope_theta") or theta),
        rope_scaling=scaling,
        local_rope_theta=float(local.get("rope_theta") or 500_000.0) if any_window else None,
        **_olmo_fields(cfg),
        **window_fields(windows),
    )
