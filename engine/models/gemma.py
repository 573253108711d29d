"""Gemma 2 and Gemma 3 (text) on the plain decoder.

Both: embeddings times sqrt(hidden) in the model dtype, RMSNorm scaling by (1 + w), a norm closing each
sub-block (post-attention, pre- and post-feed-forward), gelu_pytorch_tanh, softmax scale
query_pre_attn_scalar ** -0.5, final logit soft-capping, sliding windows on some layers (layer_types).
Gemma 2 soft-caps attention logits and alternates windowed and full layers; Gemma 3 normalises each head
of q and k, windows five layers in six, and turns its windowed layers with their own rope base
(rope_local_base_freq). transformers' Gemma 3 never soft-caps attention, whatever the config says, so
neither does this.
"""

from __future__ import annotations

from typing import Any

from engine.models.args import (
    ModelArgs,
    attention_bias_fields,
    common_fields,
    layer_type_rope,
    layer_windows,
    refuse,
    rope_fields,
    window_fields,
)


def _gemma_fields(cfg: dict[str, Any], default_types: list[str]) -> dict[str, Any]:
    refuse(cfg, use_bidirectional_attention=False)
    fields = common_fields(cfg)
    fields["hidden_act"] = str(cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh")
    scalar = float(cfg.get("query_pre_attn_scalar") or fields["head_dim"])
    final_cap = cfg.get("final_logit_softcapping")
    return dict(
        fields,
        **attention_bias_fields(cfg),
        mlp_bias=False,
        gemma_norms=True,
        embed_scale=True,
        attn_scale=scalar**-0.5,
        final_softcap=float(final_cap) if final_cap else None,
        **window_fields(layer_windows(cfg, default_types)),
    )


def parse_gemma2(cfg: dict[str, Any], arch: str) -> ModelArgs:
    n = int(cfg["num_hidden_layers"])
    rope = rope_fields(cfg, ())
    attn_cap = cfg.get("attn_logit_softcapping")
    return ModelArgs(
        architecture=arch,
        **rope,
        attn_softcap=float(attn_cap) if attn_cap else None,
        **_gemma_fields(cfg, ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]),
    )


def parse_gemma3(cfg: dict[str, Any], arch: str) -> ModelArgs:
    n = int(cfg["num_hidden_layers"])
    pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)

    def older() -> tuple[dict[str, Any], dict[str, Any]]:
        full = dict(cfg.get("rope_scaling") or {}, rope_theta=cfg.get("rope_theta") or 1_000_000.0)
        return full, {"rope_theta": cfg.get("rope_local_base_freq") or 10_000.0}

    full_theta, scaling, local = layer_type_rope(cfg, arch, older, ("linear", "yarn"), 10_000.0)
    return ModelArgs(
        architecture=arch,
        rope_theta=full_theta,
        rope_scaling=scaling,
        qk_norm=True,
        local_rope_theta=float(local.get("rope_theta") or 10_000.0),
        **_gemma_fields(cfg, ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]),
    )
