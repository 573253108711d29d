"""Phi-3 (and Phi-3.5 / Phi-4-mini, which keep its architecture name) on the plain decoder.

The checkpoint fuses q|k|v (self_attn.qkv_proj) and gate|up (mlp.gate_up_proj); long-context versions use
longrope (older configs call it "su" or "yarn", which transformers reads as longrope too); Phi-4-mini turns
only part of each head (partial_rotary_factor); a sliding_window, when set, applies to every layer.
"""

from __future__ import annotations

from typing import Any

from engine.models.args import ModelArgs, common_fields, refuse, rope_fields, window_fields


def parse(cfg: dict[str, Any], arch: str) -> ModelArgs:
    cfg = dict(cfg)
    for key in ("rope_scaling", "rope_parameters"):
        scaling = cfg.get(key)
        if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) in ("su", "yarn"):
            cfg[key] = {k: v for k, v in scaling.items() if k != "type"} | {"rope_type": "longrope"}
    refuse(cfg, attention_bias=False)
    rope = rope_fields(cfg, ("longrope", "linear"))
    window = cfg.get("sliding_window")
    n = int(cfg["num_hidden_layers"])
    return ModelArgs(
        architecture=arch,
        **common_fields(cfg),
        **rope,
        fused_qkv=True,
        **window_fields((int(window) if window else None,) * n),
    )
