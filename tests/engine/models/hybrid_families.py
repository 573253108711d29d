"""Tiny random checkpoints of the hybrid families (transformers' own classes, saved with save_pretrained).

LFM2: conv and attention layers interleaved (conv first), a kernel of 3, biased convolutions. Qwen3.5: three
Gated DeltaNet layers before a gated full-attention layer with partial rotary, two key heads serving four value
heads. Granite 4.0-H: Mamba-2 layers around one attention layer, two groups, SSD chunks of 8 (prompts cross
them), every multiplier apart from 1, with experts and rope, or dense without rope. Each has Qwen2.5's
tokenizer, so the real server can run it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

HYBRIDS: dict[str, dict[str, Any]] = {
    "lfm2": dict(
        config="Lfm2Config",
        model="Lfm2ForCausalLM",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        layer_types=["conv", "full_attention", "conv", "conv"],
        conv_L_cache=3,
        conv_bias=True,
        block_auto_adjust_ff_dim=False,
        tie_word_embeddings=True,
        max_position_embeddings=1024,
    ),
    "qwen3_5": dict(
        config="Qwen3_5TextConfig",
        model="Qwen3_5ForCausalLM",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        tie_word_embeddings=False,
        max_position_embeddings=1024,
    ),
    "granite_h": dict(
        config="GraniteMoeHybridConfig",
        model="GraniteMoeHybridForCausalLM",
        hidden_size=64,
        intermediate_size=32,
        shared_intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        mamba_n_heads=4,
        mamba_d_head=32,
        mamba_d_state=16,
        mamba_n_groups=2,
        mamba_d_conv=4,
        mamba_chunk_size=8,
        position_embedding_type="rope",
        embedding_multiplier=2.0,
        residual_multiplier=0.5,
        attention_multiplier=0.3,
        logits_scaling=4.0,
        num_local_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
        max_position_embeddings=1024,
    ),
}
# Granite 4.0-H without experts and without rope (its attention layers see no positions)
HYBRIDS["granite_h_dense"] = dict(HYBRIDS["granite_h"], num_local_experts=0, position_embedding_type=None)
VOCAB = 151_646
SEED = 2026


def build_hybrid(root: Path, family: str, **overrides: Any) -> Path:
    """The family's checkpoint in root/family (built once: an existing folder is returned as is)."""
    import torch
    import transformers

    from demo.checkpoints import _reinit, _save, _seeded, _write_atomically

    path = root / (family + "".join(f"-{k}{v}" for k, v in sorted(overrides.items())))
    if path.is_dir():
        return path
    kw = dict(HYBRIDS[family], **overrides)
    config_cls, model_cls = getattr(transformers, kw.pop("config")), getattr(transformers, kw.pop("model"))
    config = config_cls(
        vocab_size=kw.pop("vocab_size", VOCAB),
        bos_token_id=151643,
        eos_token_id=151645,
        pad_token_id=0,
        architectures=[model_cls.__name__],
        **kw,
    )
    model = _seeded(model_cls, config, SEED, _reinit, int(kw["hidden_size"])).to(torch.float32)
    gen = {"bos_token_id": 151643, "eos_token_id": [151645, 151643], "pad_token_id": 151643}
    return _write_atomically(path, lambda tmp: _save(tmp, model, 1, gen, "qwen2.5"))


def build_plain_draft(root: Path) -> Path:
    """A tiny Qwen2 (attention only) with the hybrids' tokenizer: a draft model for them."""
    import torch
    import transformers

    from demo.checkpoints import _reinit, _save, _seeded, _write_atomically

    path = root / "qwen2-draft"
    if path.is_dir():
        return path
    config = transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=151643,
        eos_token_id=151645,
        architectures=["Qwen2ForCausalLM"],
    )
    model = _seeded(transformers.Qwen2ForCausalLM, config, SEED, _reinit, 32).to(torch.float32)
    gen = {"bos_token_id": 151643, "eos_token_id": [151645, 151643], "pad_token_id": 151643}
    return _write_atomically(path, lambda tmp: _save(tmp, model, 1, gen, "qwen2.5"))
