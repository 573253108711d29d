"""Llama, Qwen2 and Mistral (and Qwen3, the same with per-head q/k norms) on the plain decoder.

They differ only in config: Qwen2 has q/k/v biases, Mistral may use a sliding window, Llama 3 scales its
rotary frequencies, Qwen3 normalises each head of q and k and sets head_dim apart from hidden / heads.
"""

from __future__ import annotations

from typing import Any

from engine.models.args import ModelArgs, common_fields, qwen_windows, rope_settings, window_fields

LLAMA_ROPE = ("linear", "llama3", "yarn")


def parse(cfg: dict[str, Any], arch: str) -> ModelArgs:
    """config.json of a LlamaForCausalLM / Qwen2ForCausalLM / MistralForCausalLM / Qwen3ForCausalLM."""
    theta, scaling = rope_settings(cfg, LLAMA_ROPE)
    if arch == "MistralForCausalLM":
        window = cfg.get("sliding_window")
        windows: tuple[int | None, ...] = (int(window) if window else None,) * int(cfg["num_hidden_layers"])
    else:
        windows = qwen_windows(cfg) if arch.startswith("Qwen") else (None,) * int(cfg["num_hidden_layers"])
    biased = bool(cfg.get("attention_bias")) and arch in ("LlamaForCausalLM", "Qwen3ForCausalLM")
    return ModelArgs(
        architecture=arch,
        **common_fields(cfg),
        rope_theta=theta,
        rope_scaling=scaling,
        qkv_bias=arch == "Qwen2ForCausalLM" or biased,
        o_bias=biased,
        mlp_bias=arch == "LlamaForCausalLM" and bool(cfg.get("mlp_bias")),
        qk_norm=arch == "Qwen3ForCausalLM",
        **window_fields(windows),
    )
