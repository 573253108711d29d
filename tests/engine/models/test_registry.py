"""The registry: every listed architecture parses to its family's settings; an unsupported architecture or an
unimplemented config feature is refused in one line that names it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine.models.args import ConfigError
from engine.models.registry import MODELS, parse_config
from tests.engine.models.families import FAMILIES, WINDOW


def config_of(ckpt: Path) -> dict[str, Any]:
    return dict(json.loads((ckpt / "config.json").read_text()))


@pytest.mark.parametrize("family_ckpt", list(FAMILIES), indirect=True)
def test_each_family_parses_to_its_features(family_ckpt: Path) -> None:
    args = parse_config(config_of(family_ckpt))
    assert args.architecture in MODELS
    name = family_ckpt.name
    assert args.qk_norm == (name in ("qwen3", "qwen3_moe", "gemma3", "gemma4", "olmo2", "olmo3"))
    assert args.gemma_norms == args.embed_scale == name.startswith("gemma")
    assert (args.moe is not None) == (name in ("qwen3_moe", "mixtral"))
    if name == "qwen3":
        assert args.head_dim == 32 != args.hidden_size // args.num_heads and args.rope_scaling is not None
    if name == "qwen3_moe":
        assert args.moe is not None and args.moe.sparse_layers == (True, False) and args.moe.num_experts == 8
    if name == "mixtral":
        assert args.moe is not None and args.moe.expert_names == ("w1", "w3", "w2") and args.moe.top_k == 2
    if name == "gemma2":
        assert args.windows == (WINDOW, None) and args.attn_softcap == 3.0 and args.final_softcap == 5.0
        assert args.attn_scale == pytest.approx(24**-0.5)
    if name == "gemma3":
        assert args.windows == (WINDOW, None) and args.local_rope_theta == 100.0 and args.attn_softcap is None
        assert args.rope_scaling is not None and args.rope_scaling["rope_type"] == "linear"
    assert args.nope_layers == ((False, True, False, True) if name == "smollm3" else ())  # a NoPE layer every 2nd
    assert args.olmo_norms == args.qk_norm_across_heads == name.startswith("olmo")
    if name == "olmo3":  # plain rope on the windowed layers, yarn on the full ones
        assert args.windows == (WINDOW, None, WINDOW, None) and args.local_rope_theta == 500_000.0
        assert args.rope_scaling is not None and args.rope_scaling["rope_type"] == "yarn"
    if name == "gemma4":  # full layers: head_dim 32, one KV head (v = k); the last two layers read 2's and 3's K/V
        assert args.norm_offset == 0.0 and args.attn_scale == 1.0 and args.final_softcap == 5.0
        assert args.extra["shapes"] == [(2, 16), (1, 32)] * 3 and args.extra["kv_sources"] == [0, 1, 2, 3, 2, 3]
        assert args.extra["k_eq_v"] == [False, True] * 3 and args.windows == (WINDOW, None) * 3
    if name == "phi3":
        assert args.fused_qkv and args.rotary_dim == 8 and args.rope_scaling is not None
        assert args.rope_scaling["rope_type"] == "longrope"
        assert args.rope_scaling["original_max_position_embeddings"] == 32


@pytest.mark.parametrize("family_ckpt", ["qwen3_moe"], indirect=True)
def test_qwen3_moe_layer_pattern(family_ckpt: Path) -> None:
    cfg = config_of(family_ckpt) | {"num_hidden_layers": 4, "mlp_only_layers": [], "decoder_sparse_step": 2}
    moe = parse_config(cfg).moe
    assert moe is not None and moe.sparse_layers == (False, True, False, True)  # (i + 1) % step == 0
    moe = parse_config(cfg | {"mlp_only_layers": [3]}).moe
    assert moe is not None and moe.sparse_layers == (False, True, False, False)


@pytest.mark.parametrize("family_ckpt", ["smollm3"], indirect=True)
def test_smollm3_windows_only_with_use_sliding_window(family_ckpt: Path) -> None:
    """transformers' default layer types window the NoPE layers, and only under use_sliding_window."""
    cfg = config_of(family_ckpt) | {"layer_types": None, "sliding_window": WINDOW}
    assert parse_config(cfg).windows == (None,) * 4
    assert parse_config(cfg | {"use_sliding_window": True}).windows == (None, WINDOW, None, WINDOW)


def test_unsupported_architecture_names_it_and_lists_the_supported() -> None:
    with pytest.raises(ConfigError) as e:
        parse_config({"architectures": ["GPT2LMHeadModel"], "hidden_size": 8})
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("architecture GPT2LMHeadModel is not supported; supported: ")
    assert all(arch in msg for arch in MODELS)


@pytest.mark.parametrize(
    "family_ckpt,change,field",
    [
        ("gemma2", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        (
            "gemma3",
            {
                "rope_parameters": {
                    "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                    "sliding_attention": {"rope_type": "linear", "factor": 2.0},
                }
            },
            "rope_parameters.sliding_attention.rope_type",
        ),
        (
            "qwen3",
            {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}},
            "rope_scaling.rope_type 'dynamic'",
        ),
        ("phi3", {"attention_bias": True}, "attention_bias"),
        ("gemma2", {"layer_types": ["chunked_attention", "full_attention"]}, "layer_types"),
        ("mixtral", {"hidden_act": "relu"}, "hidden_act 'relu'"),
        ("qwen3_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok 9"),
        ("qwen3_moe", {"num_local_experts": None}, "num_experts"),
        ("qwen3", {"num_attention_heads": 3}, "num_attention_heads 3"),
        ("smollm3", {"no_rope_layers": [1, 0]}, "no_rope_layers"),
        ("smollm3", {"layer_types": ["sliding_attention"] * 4, "sliding_window": 8}, "use_sliding_window"),
        ("olmo3", {"layer_types": ["chunked_attention"] * 4}, "layer_types"),
        (
            "olmo3",
            {
                "rope_parameters": {
                    "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                    "sliding_attention": {"rope_type": "linear", "factor": 2.0},
                }
            },
            "rope_parameters.sliding_attention.rope_type",
        ),
        ("olmo3", {"rope_parameters": None, "rope_scaling": {"rope_type": "dynamic"}}, "rope_type 'dynamic'"),
        ("gemma4", {"enable_moe_block": True}, "enable_moe_block"),
        ("gemma4", {"use_bidirectional_attention": "vision"}, "use_bidirectional_attention"),
        ("gemma4", {"attention_bias": True}, "attention_bias"),
        ("gemma4", {"num_kv_shared_layers": 6}, "num_kv_shared_layers 6"),
        ("gemma4", {"num_kv_shared_layers": 5}, "num_kv_shared_layers 5"),  # no full layer left to hold K/V
        ("gemma4", {"per_layer_config": {"1": {"sliding_window": 4}}}, "per_layer_config.1"),
        ("gemma4", {"vocab_size_per_layer_input": 1000}, "vocab_size_per_layer_input 1000"),
        (
            "gemma4",
            {"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
            "rope_parameters.sliding_attention.rope_type",
        ),
        (
            "gemma4",
            {"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2.0}}},
            "rope_parameters.full_attention.rope_type",
        ),
    ],
    indirect=["family_ckpt"],
)
def test_unimplemented_feature_names_its_field(family_ckpt: Path, change: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        parse_config(config_of(family_ckpt) | change)


def test_missing_field_is_named(qwen2_ckpt: Path) -> None:
    cfg = config_of(qwen2_ckpt)
    del cfg["hidden_size"]
    with pytest.raises(ConfigError, match="Qwen2ForCausalLM config.json lacks 'hidden_size'"):
        parse_config(cfg)
