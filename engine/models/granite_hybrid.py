"""Granite 4.0-H (GraniteMoeHybridForCausalLM): Mamba-2 layers (engine/models/recurrent/mamba2.py) mixed with
attention, each layer's MLP a shared gated MLP plus, with experts, a top-k sparse MoE.

Granite's multipliers: embeddings times `embedding_multiplier`, each sub-block's output times
`residual_multiplier` before its residual add, attention's softmax scale `attention_multiplier`, logits divided
by `logits_scaling`. Rope only with position_embedding_type "rope" (else the attention layers see no positions).
config.json: `layer_types` / `layers_block_type` (mamba / attention, or linear_attention / full_attention) and
the `mamba_*` dimensions.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.layers.linear import make_linear
from engine.layers.moe import ACTIVATIONS, SparseMoE
from engine.models.args import (
    ConfigError,
    ModelArgs,
    attention_bias_fields,
    checked_layer_types,
    common_fields,
    rope_fields,
)
from engine.models.decoder import Checkpoint, GatedMLP, WeightSource, fused_rows
from engine.models.hybrid import MLP, AttnBlock, Block, HybridLM, RecurrentBlock
from engine.models.recurrent.mamba2 import Mamba2, SSDDims

ARCHITECTURE = "GraniteMoeHybridForCausalLM"
_TYPES = {"mamba": "mamba", "linear_attention": "mamba", "attention": "attention", "full_attention": "attention"}
_SSD = ("mamba_n_heads", "mamba_d_state", "mamba_n_groups", "mamba_d_conv")


def layer_types(cfg: dict[str, Any]) -> list[str]:
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types") or cfg.get("layers_block_type") or ["mamba"] * n
    return [_TYPES[t] for t in checked_layer_types(types, n, tuple(_TYPES), "mamba, attention")]


def _number(v: Any) -> float:
    """A float, also as transformers writes infinity in JSON: {"__float__": "Infinity"}."""
    return float(v["__float__"] if isinstance(v, dict) else v)


def _ssd(cfg: dict[str, Any], hidden: int, eps: float) -> SSDDims:
    missing = [k for k in _SSD if k not in cfg]
    if missing:
        raise ConfigError(f"{ARCHITECTURE} config.json lacks {missing[0]} (a Mamba-2 state dimension)")
    heads, inner = int(cfg["mamba_n_heads"]), int(float(cfg.get("mamba_expand", 2)) * hidden)
    head_dim = cfg.get("mamba_d_head", "auto")
    head_dim = inner // heads if head_dim == "auto" else int(head_dim)
    if head_dim * heads != inner:
        raise ConfigError(f"mamba_d_head {head_dim} x mamba_n_heads {heads} is not mamba_expand x hidden_size")
    limit = cfg.get("time_step_limit") or (0.0, float("inf"))
    return SSDDims(
        heads,
        head_dim,
        int(cfg["mamba_d_state"]),
        int(cfg["mamba_n_groups"]),
        int(cfg["mamba_d_conv"]),
        int(cfg.get("mamba_chunk_size") or 256),
        eps,
        (_number(limit[0]), _number(limit[1])),
    )


def parse(cfg: dict[str, Any], arch: str) -> ModelArgs:
    cfg = {**cfg, "intermediate_size": cfg.get("intermediate_size") or cfg.get("shared_intermediate_size")}
    pos = cfg.get("position_embedding_type")
    if pos not in (None, "rope", "nope"):
        raise ConfigError(f"{arch} with position_embedding_type={pos!r} is not supported; supported: rope, nope")
    rope = rope_fields(cfg, ())
    fields = common_fields(cfg)
    e, k = int(cfg.get("num_local_experts") or 0), int(cfg.get("num_experts_per_tok") or 0)
    if e and not 0 < k <= e:
        raise ConfigError(f"num_experts_per_tok {k} must be in 1..num_local_experts ({e})")
    extra: dict[str, Any] = {
        "layer_types": tuple(layer_types(cfg)),
        "ssd": _ssd(cfg, fields["hidden_size"], fields["rms_norm_eps"]),
        "rope": pos == "rope",
        "experts": (e, k),
        "multipliers": tuple(
            float(cfg.get(k) or 1.0)
            for k in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")
        ),
        "mamba_proj_bias": bool(cfg.get("mamba_proj_bias")),
        "mamba_conv_bias": bool(cfg.get("mamba_conv_bias", True)),
    }
    return ModelArgs(architecture=arch, **fields, **rope, **attention_bias_fields(cfg), extra=extra)


class TopKMoE(SparseMoE):
    """Granite's router: a softmax over the top k logits (float32), the weights in the model dtype."""

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top, ids = torch.topk(self.router(x).float(), self.top_k, dim=-1)
        return torch.softmax(top, dim=-1).to(x.dtype), ids


class SharedMoE:
    """The experts' sum plus the shared MLP's, as Granite adds them."""

    def __init__(self, moe: SparseMoE, shared: GatedMLP) -> None:
        self.moe, self.shared = moe, shared

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x) + self.shared(x)


class GraniteHybridLM(HybridLM):
    @classmethod
    def load(cls, ck: Checkpoint) -> GraniteHybridLM:
        model = cls.from_blocks(ck, _block, "model.norm.weight")
        embed, residual, attention, logits = ck.args.extra["multipliers"]
        model.embedding_multiplier, model.residual_scale, model.scale = embed, residual, attention
        model.logits_scaling, model.turns = logits, ck.args.extra["rope"]
        return model

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed_tokens(input_ids) * self.embedding_multiplier


def _mlp(args: ModelArgs, p: str, get: WeightSource, qz: str | None) -> MLP:
    shared = GatedMLP(
        make_linear(get(f"{p}.shared_mlp.input_linear.weight"), None, qz),
        make_linear(get(f"{p}.shared_mlp.output_linear.weight"), None, qz),
        ACTIVATIONS[args.hidden_act],
    )
    num_experts, top_k = args.extra["experts"]
    if not num_experts:
        return shared
    m = f"{p}.block_sparse_moe"
    new = f"{m}.experts.gate_up_proj" in get  # transformers 5's names; older files: input_linear / router.layer
    moe = TopKMoE(
        get(f"{m}.router.weight" if new else f"{m}.router.layer.weight"),
        get(f"{m}.experts.gate_up_proj" if new else f"{m}.input_linear.weight"),
        get(f"{m}.experts.down_proj" if new else f"{m}.output_linear.weight"),
        top_k=top_k,
        norm_topk_prob=True,
        weights_in_model_dtype=True,
        activation=args.hidden_act,
    )
    return SharedMoE(moe, shared)


def _block(args: ModelArgs, i: int, get: WeightSource, qz: str | None) -> Block:
    p = f"model.layers.{i}"
    ln1, ln2, mlp = (
        get(f"{p}.input_layernorm.weight"),
        get(f"{p}.post_attention_layernorm.weight"),
        _mlp(args, p, get, qz),
    )
    if args.extra["layer_types"][i] == "attention":
        a = f"{p}.self_attn"
        bias = fused_rows([get(f"{a}.{n}_proj.bias") for n in "qkv"]) if args.qkv_bias else None
        return AttnBlock(
            make_linear(fused_rows([get(f"{a}.{n}_proj.weight") for n in "qkv"]), bias, qz),
            make_linear(get(f"{a}.o_proj.weight"), get(f"{a}.o_proj.bias") if args.o_bias else None, qz),
            None,
            None,
            None,
            ln1,
            ln2,
            mlp,
        )
    mb, x = f"{p}.mamba", args.extra
    mixer = Mamba2(
        x["ssd"],
        make_linear(get(f"{mb}.in_proj.weight"), get(f"{mb}.in_proj.bias") if x["mamba_proj_bias"] else None, qz),
        make_linear(get(f"{mb}.out_proj.weight"), get(f"{mb}.out_proj.bias") if x["mamba_proj_bias"] else None, qz),
        {
            "conv": get(f"{mb}.conv1d.weight").squeeze(1),
            "conv_bias": get(f"{mb}.conv1d.bias") if x["mamba_conv_bias"] else None,
            "A_log": get(f"{mb}.A_log"),
            "D": get(f"{mb}.D"),
            "dt_bias": get(f"{mb}.dt_bias"),
            "norm": get(f"{mb}.norm.weight"),
        },
    )
    return RecurrentBlock(mixer, ln1, ln2, mlp)
