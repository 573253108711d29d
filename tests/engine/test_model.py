"""The model's pieces against transformers' own: rotary frequencies, RoPE, RMSNorm, config parsing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from engine.layers.ops import apply_rope, rms_norm, rope_factors, rotate
from engine.models.args import ConfigError
from engine.models.registry import parse_config
from engine.models.rope import inv_freq, rope_table

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def llama_config(**kw: Any) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        head_dim=64,
        num_hidden_layers=1,
        intermediate_size=64,
        vocab_size=100,
        **kw,
    )


@pytest.mark.parametrize("scaling", [LLAMA3, {"rope_type": "linear", "factor": 4.0}])
def test_scaled_inv_freq_matches_transformers(scaling: dict[str, Any]) -> None:
    cfg = llama_config(rope_theta=500_000.0, rope_scaling=scaling)
    ref, _ = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](cfg, "cpu")
    ours, _ = inv_freq(64, 500_000.0, scaling, max_positions=4096, max_position_embeddings=4096)
    torch.testing.assert_close(ours, ref, atol=0, rtol=1e-6)
    plain, _ = inv_freq(64, 500_000.0, None, max_positions=4096, max_position_embeddings=4096)
    assert not torch.allclose(ours, plain)  # the scaling did something


def test_apply_rope_matches_transformers() -> None:
    cfg = llama_config(rope_theta=10_000.0)
    positions = torch.tensor([0, 1, 5, 17, 300])
    cos, sin = LlamaRotaryEmbedding(cfg)(torch.zeros(1), positions[None])
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 4, 64, generator=g), torch.randn(5, 2, 64, generator=g)
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    table = rope_table(64, 10_000.0, None, 512, 4096)[positions]
    torch.testing.assert_close(apply_rope(q, table), ref_q[0].transpose(0, 1), atol=1e-5, rtol=0)
    torch.testing.assert_close(apply_rope(k, table), ref_k[0].transpose(0, 1), atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_transformers(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(7, 32, generator=g) * 3).to(dtype)
    ref = Qwen2RMSNorm(32, eps=1e-6)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(32, generator=g))
    ref = ref.to(dtype)
    with torch.no_grad():
        torch.testing.assert_close(rms_norm(x, ref.weight, 1e-6), ref(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 896), (16, 896), (5, 14, 64), (3, 4096)])
def test_fused_rms_norm_rounds_as_the_float32_form(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """rms_norm runs torch's fused kernel: bitwise the float32 norm rounded once to the input's dtype, as
    transformers computes it, on rows of very different scales."""
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(*shape, generator=g) * torch.rand(*shape[:-1], 1, generator=g).mul(50)).to(dtype)
    w = torch.randn(shape[-1], generator=g).to(dtype)
    xf = x.float()
    assert torch.equal(rms_norm(x, w, 1e-6), w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype))


def test_bf16_rope_is_bitwise_transformers() -> None:
    """In bfloat16 the factors are taken in bfloat16 and each product rounded, as transformers does."""
    cfg = llama_config(rope_theta=10_000.0)
    positions = torch.tensor([0, 1, 5, 17, 300, 511])
    cos, sin = LlamaRotaryEmbedding(cfg)(torch.zeros(1, dtype=torch.bfloat16), positions[None])
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(6, 14, 64, generator=g).bfloat16(), torch.randn(6, 2, 64, generator=g).bfloat16()
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    factors = rope_factors(rope_table(64, 10_000.0, None, 512, 4096)[positions], torch.bfloat16)
    assert torch.equal(rotate(q, *factors), ref_q[0].transpose(0, 1))
    assert torch.equal(rotate(k, *factors), ref_k[0].transpose(0, 1))


def hf_dict(**kw: Any) -> dict[str, Any]:
    return json.loads(llama_config(**kw).to_json_string()) | {"architectures": ["LlamaForCausalLM"]}


def test_rope_settings_old_and_new_config_styles_agree() -> None:
    new = hf_dict(rope_theta=500_000.0, rope_scaling=LLAMA3)
    assert "rope_parameters" in new  # transformers 5 writes them nested
    old = {k: v for k, v in new.items() if k != "rope_parameters"} | {"rope_theta": 500_000.0, "rope_scaling": LLAMA3}
    a, b = parse_config(new), parse_config(old)
    assert a == b and a.rope_theta == 500_000.0 and a.rope_scaling is not None
    assert a.rope_scaling["factor"] == 8.0


def test_default_rope_and_head_dim_fallback() -> None:
    cfg = hf_dict(rope_theta=10_000.0)
    del cfg["head_dim"]
    args = parse_config(cfg)
    assert args.rope_scaling is None and args.head_dim == 256 // 4 and not args.qkv_bias


def test_architecture_flags(qwen2_ckpt: Path, mistral_ckpt: Path) -> None:
    qwen = parse_config(json.loads((qwen2_ckpt / "config.json").read_text()))
    mistral = parse_config(json.loads((mistral_ckpt / "config.json").read_text()))
    assert qwen.qkv_bias and not qwen.o_bias and qwen.tie_word_embeddings and qwen.sliding_window is None
    assert not mistral.qkv_bias and mistral.sliding_window == 8


def test_unsupported_config_is_refused() -> None:
    with pytest.raises(ConfigError, match="GPT2LMHeadModel"):
        parse_config(hf_dict() | {"architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ConfigError, match="gelu"):
        parse_config(hf_dict() | {"hidden_act": "gelu"})
    with pytest.raises(ConfigError, match="rope_scaling.rope_type 'dynamic'"):
        parse_config(hf_dict() | {"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}})
    with pytest.raises(ValueError, match="dynamic"):
        inv_freq(64, 10_000.0, {"rope_type": "dynamic", "factor": 4.0}, max_positions=8, max_position_embeddings=8)


def test_qwen2_windows_on_some_layers() -> None:
    mixed = hf_dict() | {
        "architectures": ["Qwen2ForCausalLM"],
        "use_sliding_window": True,
        "num_hidden_layers": 2,
        "sliding_window": 16,
        "layer_types": ["full_attention", "sliding_attention"],
    }
    args = parse_config(mixed)
    assert args.sliding_window is None and args.windows == (None, 16)
