"""LFM2: short gated convolutions (engine/models/recurrent/short_conv.py) mixed with GQA attention layers.

config.json: `layer_types` ("conv" / "full_attention"; older files give `full_attn_idxs`), `conv_L_cache` (the
kernel size L: the state per conv layer is its last L - 1 inputs), `conv_bias`, `norm_eps`. Attention normalises
each head of q and k (q_layernorm / k_layernorm) and turns whole heads; the MLP is w2(silu(w1 x) * w3 x).
"""

from __future__ import annotations

from typing import Any

from engine.layers.linear import make_linear
from engine.models.args import ConfigError, ModelArgs, checked_layer_types, common_fields, refuse, rope_fields
from engine.models.decoder import Checkpoint, WeightSource, fused_rows
from engine.models.hybrid import AttnBlock, Block, HybridLM, RecurrentBlock, gated_mlp
from engine.models.recurrent.short_conv import ShortConv

ARCHITECTURE = "Lfm2ForCausalLM"
LAYER_TYPES = ("conv", "full_attention")


def layer_types(cfg: dict[str, Any]) -> list[str]:
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:
        if cfg.get("full_attn_idxs") is None:
            raise ConfigError(f"{ARCHITECTURE} config.json has neither layer_types nor full_attn_idxs")
        full = {int(i) for i in cfg["full_attn_idxs"]}
        types = ["full_attention" if i in full else "conv" for i in range(n)]
    return checked_layer_types(types, n, tuple(LAYER_TYPES))


def parse(cfg: dict[str, Any], arch: str) -> ModelArgs:
    refuse(cfg, attention_bias=False)
    if "conv_L_cache" not in cfg or int(cfg["conv_L_cache"]) < 1:
        raise ConfigError(f"{arch} config.json lacks conv_L_cache (the convolution's state length)")
    cfg = dict(cfg, intermediate_size=cfg.get("intermediate_size") or cfg.get("block_ff_dim"))
    rope = rope_fields(cfg, ())
    types = layer_types(cfg)
    tie = cfg.get("tie_word_embeddings", cfg.get("tie_embedding"))
    return ModelArgs(
        architecture=arch,
        **dict(common_fields(cfg), rms_norm_eps=float(cfg.get("norm_eps", 1e-5)), tie_word_embeddings=tie),
        **rope,
        qk_norm=True,
        extra={"layer_types": tuple(types), "conv_bias": bool(cfg.get("conv_bias"))},
    )


class Lfm2LM(HybridLM):
    @classmethod
    def load(cls, ck: Checkpoint) -> Lfm2LM:
        return cls.from_blocks(ck, _block, "model.embedding_norm.weight")


def _block(args: ModelArgs, i: int, get: WeightSource, qz: str | None) -> Block:
    p = f"model.layers.{i}"
    mlp = gated_mlp(args, get, qz, *(f"{p}.feed_forward.{w}.weight" for w in ("w1", "w3", "w2")))
    ln1, ln2 = get(f"{p}.operator_norm.weight"), get(f"{p}.ffn_norm.weight")
    if args.extra["layer_types"][i] == "full_attention":
        a = f"{p}.self_attn"
        qkv = fused_rows([get(f"{a}.{n}_proj.weight") for n in "qkv"])
        return AttnBlock(
            make_linear(qkv, None, qz),
            make_linear(get(f"{a}.out_proj.weight"), None, qz),
            get(f"{a}.q_layernorm.weight"),
            get(f"{a}.k_layernorm.weight"),
            None,
            ln1,
            ln2,
            mlp,
        )
    c, bias = f"{p}.conv", args.extra["conv_bias"]
    conv = ShortConv(
        make_linear(get(f"{c}.in_proj.weight"), get(f"{c}.in_proj.bias") if bias else None, qz),
        make_linear(get(f"{c}.out_proj.weight"), get(f"{c}.out_proj.bias") if bias else None, qz),
        get(f"{c}.conv.weight").squeeze(1),
        get(f"{c}.conv.bias") if bias else None,
    )
    return RecurrentBlock(conv, ln1, ln2, mlp)
