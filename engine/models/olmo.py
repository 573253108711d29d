"""OLMo 2 and OLMo 3 on the plain decoder.

Both: no norm before a sub-block, a norm closing each (post_attention_layernorm, post_feedforward_layernorm)
before the residual add, norm weights multiplying in float32 (the product rounded once); q and k each normed
over all heads at once, before rope; no rope layers apart. OLMo 3 windows three layers in four (`layer_types`,
`sliding_window`) and turns its windowed layers with plain rope: rope scaling applies to the full layers only.
"""

from __future__ import annotations

from typing import Any

from engine.models.args import (
    ModelArgs,
    attention_bias_fields,
    common_fields,
    layer_type_rope,
    layer_windows,
    rope_fields,
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

    def older() -> tuple[dict[str, Any], dict[str, Any]]:  # rope_theta for both, rope_scaling for the full layers
        theta = cfg.get("rope_theta") or 500_000.0
        return dict(cfg.get("rope_scaling") or {}, rope_theta=theta), {"rope_theta": theta}

    full_theta, scaling, local = layer_type_rope(cfg, arch, older, OLMO_ROPE, 500_000.0)  # Olmo3Config's default
    any_window = any(w is not None for w in windows)
    return ModelArgs(
        architecture=arch,
        rope_theta=full_theta,
        rope_scaling=scaling,
        local_rope_theta=float(local.get("rope_theta") or 500_000.0) if any_window else None,
        **_olmo_fields(cfg),
        **window_fields(windows),
    )
