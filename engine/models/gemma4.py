"""Gemma 4 (text): Gemma 3's decoder with per-layer input embeddings, KV shared across layers and wider full layers.

What differs from Gemma 3 (transformers' Gemma4TextModel): norms scale by w, not (1 + w); v is normed too (no
weight) and the softmax scale is 1; full-attention layers have their own head_dim (`per_layer_config` or
`global_head_dim`) and, with `attention_k_eq_v`, their own KV head count and v = k's projection (before k's norm);
they turn with "proportional" rope (the first `partial_rotary_factor` of each half of the head turns, frequencies
over the whole head_dim). The last `num_kv_shared_layers` layers compute no K/V: each attends the cache of the last
earlier layer of its type, so they hold no KV blocks (`kv_shapes` lists one cache per layer that writes one). Per-layer
inputs (PLE): each token's row of `embed_tokens_per_layer` plus a normed projection of its embedding, one slice per
layer, gate a small MLP whose output is added after the feed-forward block; every layer ends scaled by its
`layer_scalar`. The MoE block (`enable_moe_block`) and bidirectional attention are refused.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from engine.layers.linear import Linear, make_linear
from engine.layers.moe import ACTIVATIONS
from engine.models.args import ConfigError, ModelArgs, arch_of, common_fields, layer_windows, refuse, window_fields
from engine.models.decoder import CausalLM, Checkpoint, GatedMLP, Layer, Rope, WeightGetter, fused_rows, gemma_rms_norm
from engine.models.rope import rope_table

if TYPE_CHECKING:
    from engine.layers.ops import AttnMetadata
    from engine.models.step import Step

PER_LAYER_KEYS = frozenset({"head_dim", "num_key_value_heads"})


def _layer_shapes(cfg: dict[str, Any], types: list[str]) -> list[tuple[int, int]]:
    """Each layer's (kv heads, head_dim): `per_layer_config` (transformers 5's saved form) or the release's
    `global_head_dim` / `num_global_key_value_heads` for the full-attention layers."""
    per_layer = {int(k): dict(v) for k, v in (cfg.get("per_layer_config") or {}).items() if str(k).isdigit()}
    for i, overrides in per_layer.items():
        if set(overrides) - PER_LAYER_KEYS:
            raise ConfigError(
                f"{arch_of(cfg)} with per_layer_config.{i} keys {sorted(set(overrides))} is not supported"
            )
    kv, dim = int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]), int(cfg.get("head_dim") or 256)
    global_kv = cfg.get("num_global_key_value_heads") if cfg.get("attention_k_eq_v") else None
    shapes = []
    for i, t in enumerate(types):
        full = t == "full_attention"
        default = (int(global_kv or kv), int(cfg.get("global_head_dim") or 512)) if full else (kv, dim)
        if "per_layer_config" in cfg:
            default = (kv, dim)
        o = per_layer.get(i, {})
        shapes.append((int(o.get("num_key_value_heads", default[0])), int(o.get("head_dim", default[1]))))
    return shapes


def _kv_sources(types: list[str], shared: int) -> list[int]:
    """Per layer, the layer whose K/V it attends: itself, or (the last `shared` layers) the last earlier layer of
    its type that computes its own."""
    n = len(types)
    first = n - shared
    if shared and not 0 < first < n:
        raise ConfigError(f"num_kv_shared_layers {shared} leaves no layer computing K/V")
    sources = list(range(n))
    for i in range(first, n):
        owners = [j for j in range(first) if types[j] == types[i]]
        if not owners:
            raise ConfigError(
                f"num_kv_shared_layers {shared}: no earlier {types[i]} layer holds the K/V layer {i} reads"
            )
        sources[i] = owners[-1]
    return sources


def parse(cfg: dict[str, Any], arch: str) -> ModelArgs:
    """Gemma4ForCausalLM's config.json, or Gemma4ForConditionalGeneration's text_config (its text part)."""
    cfg = {**cfg, **(cfg.get("text_config") or {})}
    refuse(cfg, enable_moe_block=False, use_bidirectional_attention=None, attention_bias=False)
    n = int(cfg["num_hidden_layers"])
    types = list(cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)])
    types[-1] = "full_attention"  # as transformers forces it
    windows = layer_windows(cfg | {"layer_types": types, "sliding_window": cfg.get("sliding_window") or 512}, types)
    rope = cfg.get("rope_parameters") or {}
    local, full = dict(rope.get("sliding_attention") or {}), dict(rope.get("full_attention") or {})
    if local.get("rope_type", "default") != "default":
        raise ConfigError(
            f"{arch} with rope_parameters.sliding_attention.rope_type {local['rope_type']!r} is not supported"
        )
    if full.get("rope_type", "proportional") not in ("proportional", "default"):
        raise ConfigError(
            f"{arch} with rope_parameters.full_attention.rope_type {full['rope_type']!r} is not supported"
        )
    ple_vocab = int(cfg.get("vocab_size_per_layer_input") or cfg["vocab_size"])
    ple_dim = int(cfg.get("hidden_size_per_layer_input") or 0)
    if ple_dim and ple_vocab < int(cfg["vocab_size"]):
        raise ConfigError(f"{arch} with vocab_size_per_layer_input {ple_vocab} below vocab_size is not supported")
    fields = common_fields(cfg)
    fields["hidden_act"] = str(cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh")
    final_cap = cfg.get("final_logit_softcapping")
    extra = dict(
        shapes=_layer_shapes(cfg, types),
        kv_sources=_kv_sources(types, int(cfg.get("num_kv_shared_layers") or 0)),
        k_eq_v=[bool(cfg.get("attention_k_eq_v")) and t == "full_attention" for t in types],
        full=[t == "full_attention" for t in types],
        ple_dim=ple_dim,
        local_theta=float(local.get("rope_theta") or 10_000.0),
        full_rope=full,
    )
    return ModelArgs(
        architecture=arch,
        **fields,
        rope_theta=float(full.get("rope_theta") or 1_000_000.0),
        rope_scaling=None,
        qk_norm=True,
        gemma_norms=True,
        norm_offset=0.0,
        embed_scale=True,
        attn_scale=1.0,
        final_softcap=float(final_cap) if final_cap else None,
        extra=extra,
        **window_fields(windows),
    )


def proportional_table(head_dim: int, rope: dict[str, Any], max_positions: int) -> torch.Tensor:
    """transformers' "proportional" rope as a [positions, head_dim] cos | sin table: frequencies theta ** (-2i /
    head_dim) for the first partial_rotary_factor of the pairs, 0 (no turn) for the rest, divided by factor."""
    if rope.get("rope_type", "proportional") == "default":
        return rope_table(head_dim, float(rope.get("rope_theta") or 1_000_000.0), None, max_positions, max_positions)
    angles = int(float(rope.get("partial_rotary_factor", 1.0)) * head_dim // 2)
    theta = float(rope.get("rope_theta") or 1_000_000.0)
    turned = 1.0 / theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / head_dim)
    freq = torch.cat([turned, torch.zeros(head_dim // 2 - angles)]) / float(rope.get("factor", 1.0))
    positions = torch.outer(torch.arange(max_positions, dtype=torch.float32), freq)
    return torch.cat([positions.cos(), positions.sin()], dim=-1)


class Gemma4Layer(Layer):
    """A Gemma 4 layer's weights: q|k|v (q|k where v = k, q alone where the layer reads another's K/V), its
    head shape, the per-layer-input MLP and the layer's scalar."""

    ln1: torch.Tensor
    ln2: torch.Tensor
    post_attn_norm: torch.Tensor
    post_ff_norm: torch.Tensor
    q_norm: torch.Tensor

    def __init__(self, args: ModelArgs, index: int, get: WeightGetter, quantization: str | None = None) -> None:
        p, qz, x = f"model.layers.{index}", quantization, args.extra

        def norm(name: str) -> torch.Tensor:
            return get(f"{p}.{name}.weight").float()

        self.kv_heads, self.head_dim = x["shapes"][index]
        self.owns_kv = x["kv_sources"][index] == index
        self.k_eq_v = bool(x["k_eq_v"][index])
        names = (
            ["q_proj"] + (["k_proj"] if self.owns_kv else []) + (["v_proj"] if self.owns_kv and not self.k_eq_v else [])
        )
        self.qkv = make_linear(fused_rows([get(f"{p}.self_attn.{n}.weight") for n in names]), None, qz)
        self.o = make_linear(get(f"{p}.self_attn.o_proj.weight"), None, qz)
        self.q_norm = norm("self_attn.q_norm")
        self.k_norm = norm("self_attn.k_norm") if self.owns_kv else None
        self.v_scale = torch.ones(self.head_dim, device=self.q_norm.device)  # v's norm has no weight
        self.ln1, self.post_attn_norm = norm("input_layernorm"), norm("post_attention_layernorm")
        self.ln2, self.post_ff_norm = norm("pre_feedforward_layernorm"), norm("post_feedforward_layernorm")
        gate_up = fused_rows([get(f"{p}.mlp.gate_proj.weight"), get(f"{p}.mlp.up_proj.weight")])  # GGUF: blocks
        act = ACTIVATIONS[args.hidden_act]
        self.mlp = GatedMLP(
            make_linear(gate_up, None, qz), make_linear(get(f"{p}.mlp.down_proj.weight"), None, qz), act
        )
        self.ple_gate: Linear | None = None
        if x["ple_dim"]:
            self.ple_gate = make_linear(get(f"{p}.per_layer_input_gate.weight"), None, qz)
            self.ple_proj = make_linear(get(f"{p}.per_layer_projection.weight"), None, qz)
            self.ple_norm = norm("post_per_layer_input_norm")
        self.scalar = get(f"{p}.layer_scalar")


class Gemma4CausalLM(CausalLM):
    layer_class = Gemma4Layer
    gemma_norm_kernel = False  # its norms stay torch's, rounded as before

    @classmethod
    def load(cls, ck: Checkpoint) -> CausalLM:
        """A Gemma4ForConditionalGeneration checkpoint keeps the text model under model.language_model."""

        def get(name: str) -> torch.Tensor:
            nested = "model.language_model." + name.removeprefix("model.")
            return ck.weights(nested if name not in ck.weights and nested in ck.weights else name)

        return cls(ck.args, get, ck.has_lm_head, ck.max_positions, ck.quantization)

    def __init__(
        self, args: ModelArgs, get: WeightGetter, has_lm_head: bool, max_positions: int, quantization: str | None = None
    ) -> None:
        super().__init__(args, get, has_lm_head, max_positions, quantization)
        x = args.extra
        self.layers4 = [layer for layer in self.layers if isinstance(layer, Gemma4Layer)]
        owners = [i for i, src in enumerate(x["kv_sources"]) if src == i]
        self.kv_shapes = [x["shapes"][i] for i in owners]
        self.cache_of = [owners.index(src) for src in x["kv_sources"]]
        local = rope_table(args.head_dim, x["local_theta"], None, max_positions, args.max_position_embeddings)
        full_dim = next((d for (_, d), f in zip(x["shapes"], x["full"]) if f), args.head_dim)
        self.rope_tables = [
            local.to(self.device),
            proportional_table(full_dim, x["full_rope"], max_positions).to(self.device),
        ]
        self.layer_rope = [1 if f else 0 for f in x["full"]]
        self.act = ACTIVATIONS[args.hidden_act]
        self.ple_dim = int(x["ple_dim"])
        if self.ple_dim:
            self.ple_embed = get("model.embed_tokens_per_layer.weight")
            self.ple_scale = torch.tensor(math.sqrt(self.ple_dim)).to(self.dtype)
            self.ple_projection = make_linear(get("model.per_layer_model_projection.weight"), None, quantization)
            self.ple_norm = get("model.per_layer_projection_norm.weight").float()

    def forward(self, step: Step) -> torch.Tensor:
        x = self.embed_tokens(step.input_ids)
        ple = self.per_layer_inputs(step.input_ids, x) if self.ple_dim else None
        rope = self.rope_for(step.positions)
        for i, layer in enumerate(self.layers4):
            k_cache, v_cache = step.kv_caches[self.cache_of[i]]
            h = self.attention4(i, layer, self.rms_norm(x, layer.ln1), k_cache, v_cache, step.meta, rope)
            x = x + self.rms_norm(h, layer.post_attn_norm)
            x = x + self.rms_norm(layer.mlp(self.rms_norm(x, layer.ln2)), layer.post_ff_norm)
            if ple is not None and layer.ple_gate is not None:
                gated = self.act(layer.ple_gate(x)) * ple[:, i]
                x = x + self.rms_norm(layer.ple_proj(gated), layer.ple_norm)
            x = x * layer.scalar
        return x

    def per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """[T, layers, ple_dim]: each token's per-layer embedding plus its embedding's normed projection, over
        sqrt(2), rounded as transformers does."""
        t, n = x.shape[0], len(self.layers)
        tokens = (F.embedding(input_ids, self.ple_embed) * self.ple_scale).view(t, n, self.ple_dim)
        projected = (self.ple_projection(x) * self.args.hidden_size**-0.5).view(t, n, self.ple_dim)
        combined: torch.Tensor = (self.rms_norm(projected, self.ple_norm) + tokens) * 2.0**-0.5
        return combined

    def attention4(
        self,
        i: int,
        layer: Gemma4Layer,
        h: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttnMetadata,
        rope: Rope,
    ) -> torch.Tensor:
        """One layer's attention: K/V written to its own cache, or (a sharing layer) only q, attending the cache
        of the layer it reads."""
        a, t, d = self.args, h.shape[0], layer.head_dim
        out = layer.qkv(h)
        q = self.rms_norm(out[:, : a.num_heads * d].reshape(t, a.num_heads, d), layer.q_norm)
        if layer.owns_kv and layer.k_norm is not None:
            kv = layer.kv_heads * d
            k_raw = out[:, a.num_heads * d : a.num_heads * d + kv].reshape(t, layer.kv_heads, d)
            v_raw = k_raw if layer.k_eq_v else out[:, a.num_heads * d + kv :].reshape(t, layer.kv_heads, d)
            v = gemma_rms_norm(v_raw, layer.v_scale, a.rms_norm_eps)
            q, k = rope(q, self.rms_norm(k_raw, layer.k_norm), self.layer_rope[i])
            self.ops.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        else:  # the K/V are another layer's, already in its cache; only q turns
            q, _ = rope(q, q[:, :1].contiguous(), self.layer_rope[i])
        attn = self.ops.attention(q, k_cache, v_cache, meta, self.scale, window=self.layer_windows[i], softcap=None)
        return self.all_reduce(layer.o(attn.reshape(t, a.num_heads * d)))
