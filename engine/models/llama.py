"""Llama, Qwen2 and Mistral (and Qwen3, the same with per-head q/k norms; SmolLM3, Llama with NoPE layers) on
the plain decoder.

They differ only in config: Qwen2 has q/k/v biases, Mistral may use a sliding window, Llama 3 scales its
rotary frequencies, Qwen3 normalises each head of q and k and sets head_dim apart from hidden / heads,
SmolLM3 leaves q and k unturned on the layers `no_rope_layers` marks 0 (every 4th by default).
"""

from __future__ import annotations

from typing import Any

from engine.models.args import (
    ConfigError,
    ModelArgs,
    attention_bias_fields,
    common_fields,
    layer_windows,
    qwen_windows,
    rope_fields,
    window_fields,
)

LLAMA_ROPE = ("linear", "llama3", "yarn")


def parse(cfg: dict[str, Any], arch: str) -> ModelArgs:
    """config.json of a LlamaForCausalLM / Qwen2ForCausalLM / MistralForCausalLM / Qwen3ForCausalLM."""
    rope = rope_fields(cfg, LLAMA_ROPE)
    if arch == "MistralForCausalLM":
        window = cfg.get("sliding_window")
        windows: tuple[int | None, ...] = (int(window) if window else None,) * int(cfg["num_hidden_layers"])
    else:
        windows = qwen_windows(cfg) if arch.startswith("Qwen") else (None,) * int(cfg["num_hidden_layers"])
    biased = bool(cfg.get("attention_bias")) and arch in ("LlamaForCausalLM", "Qwen3ForCausalLM")
    return ModelArgs(
        architecture=arch,
        **common_fields(cfg),
        **rope,
        qkv_bias=arch == "Qwen2ForCausalLM" or biased,
        o_bias=biased,
        mlp_bias=arch == "LlamaForCausalLM" and bool(cfg.get("mlp_bias")),
        qk_norm=arch == "Qwen3ForCausalLM",
        **window_fields(windows),
    )


def parse_smollm3(cfg: dict[str, Any], arch: str) -> ModelArgs:
    """config.json of a SmolLM3ForCausalLM: Llama whose `no_rope_layers` (1: rope, 0: NoPE; by default a 0 every
    `no_rope_layer_interval` layers) say which layers turn q and k; windows only with use_sliding_window."""
    n = int(cfg["num_hidden_layers"])
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = int(cfg.get("no_rope_layer_interval") or 4)
        flags = [int((i + 1) % interval != 0) for i in range(n)]
    if len(flags) < n or any(f not in (0, 1) for f in flags):
        raise ConfigError(f"no_rope_layers {flags!r} must hold a 0 or 1 for each of the {n} layers")
    windows: tuple[int | None, ...] = (None,) * n
    if cfg.get("use_sliding_window") and cfg.get("sliding_window"):
        default = ["full_attention" if flags[i] else "sliding_attention" for i in range(n)]
        windows = layer_windows(cfg, default)
    elif "sliding_attention" in (cfg.get("layer_types") or []):  # transformers' masks and flash kernels disagree
        raise ConfigError(
            f"{arch} with layer_types naming sliding_attention and use_sliding_window off is not supported"
        )
    rope = rope_fields(cfg, LLAMA_ROPE, default_theta=2_000_000.0)  # SmolLM3Config's default
    return ModelArgs(
        architecture=arch,
        **common_fields(cfg),
        **rope,
        **attention_bias_fields(cfg),
        mlp_bias=bool(cfg.get("mlp_bias")),
        nope_layers=tuple(not flags[i] for i in range(n)),
        **window_fields(windows),
    )
