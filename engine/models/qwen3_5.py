"""Qwen3.5 (text): Gated DeltaNet layers (engine/models/recurrent/gated_deltanet.py) mixed with gated full
attention, by default three linear-attention layers before each full-attention one.

Full attention: q_proj gives each head's query and an output gate side by side (the output is multiplied by
sigmoid(gate) before o_proj), q and k are normed per head, rope turns the first head_dim * partial_rotary_factor
dims (text positions: M-RoPE's three axes agree, so plain rope). Every RMSNorm but the DeltaNet's gated one scales
by (1 + w) in float32. config.json: `layer_types` (linear_attention / full_attention) or
`full_attention_interval`; the DeltaNet's `linear_*` dimensions and kernel size.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.layers.linear import make_linear
from engine.models.args import ConfigError, ModelArgs, checked_layer_types, common_fields, refuse, rope_fields
from engine.models.decoder import Checkpoint, WeightSource, fused_rows
from engine.models.hybrid import AttnBlock, Block, HybridLM, RecurrentBlock, gated_mlp
from engine.models.recurrent.gated_deltanet import DeltaNetDims, GatedDeltaNet

ARCHITECTURE = "Qwen3_5ForCausalLM"
LAYER_TYPES = ("linear_attention", "full_attention")
_DIMS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")


def layer_types(cfg: dict[str, Any]) -> list[str]:
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:
        every = int(cfg.get("full_attention_interval") or 4)
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
    return checked_layer_types(types, n, tuple(LAYER_TYPES))


def parse(cfg: dict[str, Any], arch: str) -> ModelArgs:
    cfg = {**cfg, **(cfg.get("text_config") or {})}
    refuse(cfg, attention_bias=False)
    missing = [k for k in (*_DIMS, "linear_conv_kernel_dim") if k not in cfg]
    if missing:
        raise ConfigError(f"{arch} config.json lacks {missing[0]} (a Gated DeltaNet state dimension)")
    rope = rope_fields(cfg, ())
    k_heads, v_heads, k_dim, v_dim = (int(cfg[k]) for k in _DIMS)
    dims = DeltaNetDims(k_heads, v_heads, k_dim, v_dim, int(cfg["linear_conv_kernel_dim"]), 0.0)
    if dims.num_v_heads % dims.num_k_heads:
        raise ConfigError(
            f"linear_num_value_heads {dims.num_v_heads} is not a multiple of linear_num_key_heads {dims.num_k_heads}"
        )
    fields = common_fields(cfg)
    return ModelArgs(
        architecture=arch,
        **fields,
        **rope,
        qk_norm=True,
        gemma_norms=True,  # (1 + w) norms in float32 (engine/models/hybrid.py HybridLM.rms_norm)
        extra={"layer_types": tuple(layer_types(cfg)), "deltanet": dims},
    )


class Qwen35LM(HybridLM):
    @classmethod
    def load(cls, ck: Checkpoint) -> Qwen35LM:
        return cls.from_blocks(ck, _block, "model.norm.weight", _norm)


def _norm(w: torch.Tensor) -> torch.Tensor:
    return 1.0 + w.float()


def _block(args: ModelArgs, i: int, get: WeightSource, qz: str | None) -> Block:
    p = f"model.layers.{i}"
    mlp = gated_mlp(args, get, qz, *(f"{p}.mlp.{w}_proj.weight" for w in ("gate", "up", "down")))
    ln1, ln2 = _norm(get(f"{p}.input_layernorm.weight")), _norm(get(f"{p}.post_attention_layernorm.weight"))
    if args.extra["layer_types"][i] == "full_attention":
        a = f"{p}.self_attn"
        # q_proj holds, per head, head_dim query rows then head_dim gate rows
        q_gate = get(f"{a}.q_proj.weight").reshape(args.num_heads, 2, args.head_dim, -1)
        q, gate = (q_gate[:, j].reshape(args.num_heads * args.head_dim, -1) for j in (0, 1))
        return AttnBlock(
            make_linear(fused_rows([q, get(f"{a}.k_proj.weight"), get(f"{a}.v_proj.weight")]), None, qz),
            make_linear(get(f"{a}.o_proj.weight"), None, qz),
            _norm(get(f"{a}.q_norm.weight")),
            _norm(get(f"{a}.k_norm.weight")),
            make_linear(gate.contiguous(), None, qz),
            ln1,
            ln2,
            mlp,
        )
    la = f"{p}.linear_attn"
    names = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
    dims = args.extra["deltanet"]
    mixer = GatedDeltaNet(
        DeltaNetDims(
            dims.num_k_heads, dims.num_v_heads, dims.head_k_dim, dims.head_v_dim, dims.kernel, args.rms_norm_eps
        ),
        {n: make_linear(get(f"{la}.{n}.weight"), None, qz) for n in names},
        {
            "conv": get(f"{la}.conv1d.weight").squeeze(1),
            "A_log": get(f"{la}.A_log"),
            "dt_bias": get(f"{la}.dt_bias"),
            "norm": get(f"{la}.norm.weight"),
        },
    )
    return RecurrentBlock(mixer, ln1, ln2, mlp)
