"""Qwen3-MoE and Mixtral: the plain decoder with sparse MoE blocks (engine/layers/moe.py) for MLPs.

Qwen3-MoE: per-head q/k norms as Qwen3; experts under mlp.experts.E.{gate,up,down}_proj, the router at
mlp.gate; top-k of a softmax, renormalised when norm_topk_prob; layer i is sparse unless it is in
mlp_only_layers or (i + 1) is not a multiple of decoder_sparse_step (then a dense MLP of intermediate_size).
Mixtral: experts under block_sparse_moe.experts.E.{w1,w3,w2} (gate, up, down), top-2 renormalised.
"""

from __future__ import annotations

from typing import Any

from engine.models.args import (
    ConfigError,
    ModelArgs,
    MoEArgs,
    attention_bias_fields,
    common_fields,
    qwen_windows,
    rope_fields,
    window_fields,
)


def _num_experts(cfg: dict[str, Any]) -> int:
    # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts
    n = cfg.get("num_experts") or cfg.get("num_local_experts")
    if not n:
        raise ConfigError("num_experts (or num_local_experts) is missing")
    return int(n)


def parse_qwen3_moe(cfg: dict[str, Any], arch: str) -> ModelArgs:
    n = int(cfg["num_hidden_layers"])
    experts = _num_experts(cfg)
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = {int(i) for i in cfg.get("mlp_only_layers") or []}
    sparse = tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(n))
    moe = MoEArgs(
        num_experts=experts,
        top_k=int(cfg["num_experts_per_tok"]),
        intermediate_size=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob")),
        sparse_layers=sparse,
        router_weights_in_model_dtype=True,
        block="mlp",
        expert_names=("gate_proj", "up_proj", "down_proj"),
    )
    rope = rope_fields(cfg, ("linear", "yarn"))
    windows = qwen_windows(cfg | {"layer_types": None, "max_window_layers": 0})  # every layer, as transformers
    return ModelArgs(
        architecture=arch,
        **common_fields(cfg),
        **rope,
        **attention_bias_fields(cfg),
        qk_norm=True,
        moe=moe,
        **window_fields(windows),
    )


def parse_mixtral(cfg: dict[str, Any], arch: str) -> ModelArgs:
    n = int(cfg["num_hidden_layers"])
    moe = MoEArgs(
        num_experts=_num_experts(cfg),
        top_k=int(cfg.get("num_experts_per_tok") or 2),
        intermediate_size=int(cfg["intermediate_size"]),
        norm_topk_prob=True,
        sparse_layers=(True,) * n,
        router_weights_in_model_dtype=False,
        block="block_sparse_moe",
        expert_names=("w1", "w3", "w2"),
    )
    rope = rope_fields(cfg, ("linear", "yarn"))
    window = cfg.get("sliding_window")
    return ModelArgs(
        architecture=arch,
        **common_fields(cfg),
        **rope,
        moe=moe,
        **window_fields((int(window) if window else None,) * n),
    )
