"""One decoder for every text family (engine/models/registry.py), driven by `ModelArgs` over a paged KV cache.

Per layer: norm, fused q|k|v projection, optional per-head q/k norms, rope (per-layer table, maybe on part of
the head), the paged cache write and attention (per-layer window and soft-cap), the output projection, then a
gated MLP or a sparse MoE block; Gemma closes each sub-block with one more norm. Weights are fused at load
(q|k|v, gate|up) so a dense layer runs four matmuls.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F

from engine.cpu_kernels import layer_ops
from engine.gguf.tensor import GGMLWeight, concat_rows
from engine.layers.linear import KernelLinear, Linear, make_linear
from engine.layers.lm_head import LMHead, choose_head
from engine.layers.moe import ACTIVATIONS, Activation, SparseMoE, gelu_tanh
from engine.layers.ops import AttnMetadata, TorchOps, TritonOps, rope_factors, rope_halves, rotate
from engine.layers.parallel import WORKERS
from engine.layers.softcap import soft_cap_
from engine.models.args import ModelArgs
from engine.models.fused_decode import FUSED_LINEARS, FusedDecode, kernels_take
from engine.models.rope import rope_table
from engine.models.step import Step

if TYPE_CHECKING:
    from engine.layers.quant_linear import QuantEmbedding

WeightGetter = Callable[[str], torch.Tensor]
Rope = Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]  # (q, k, table index)


def fused_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """q|k|v or gate|up in one weight: tensors concatenated; a GGUF model's blocks (GGMLWeight, kept quantized
    on CPU) fused as blocks, or kept as parts where their types differ (engine/layers/quant_linear.py)."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts, dim=0)
    return concat_rows(parts)  # type: ignore[arg-type,return-value]  # make_linear takes blocks too


class WeightSource(Protocol):
    """The loader's weights: name -> tensor, and which names the checkpoint has."""

    def __call__(self, name: str) -> torch.Tensor: ...

    def __contains__(self, name: str) -> bool: ...


@dataclass(frozen=True)
class Checkpoint:
    """What a family's `load` builds its model from: the config, its parsed args, the weights and the loader's
    choices (the rotary table's length, the quantization)."""

    cfg: dict[str, Any]
    args: ModelArgs
    weights: WeightSource
    has_lm_head: bool
    max_positions: int
    quantization: str | None = None

    def lm_head(self) -> torch.Tensor | None:
        """The LM head's own weight, or None where the embedding serves (tie_word_embeddings, else no lm_head)."""
        tie = self.args.tie_word_embeddings
        tied = tie if tie is not None else not self.has_lm_head
        return None if tied else self.weights("lm_head.weight")


class GatedMLP:
    """down(act(gate(x)) * up(x)), gate and up fused in one projection. kernel_gelu: gelu_tanh(gate) * up of bf16
    CPU rows through layer_ops.cpp (Gemma 2 / 3's, rounded as the fused decode layer rounds it)."""

    def __init__(self, gate_up: Linear, down: Linear, act: Activation, kernel_gelu: bool = False) -> None:
        self.gate_up, self.down, self.act, self.kernel_gelu = gate_up, down, act, kernel_gelu

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.act is F.silu and isinstance(self.gate_up, KernelLinear):  # [g | u] stays in registers
            act = self.gate_up.silu_mul(x)
            if act is not None:
                return self.down(act)
        gate_up = self.gate_up(x)
        if self.act is F.silu and layer_ops.usable(gate_up):  # bf16 on CPU: one pass, rounded as below
            return self.down(layer_ops.silu_mul(gate_up, WORKERS.threads_for(0, 3 * gate_up.numel())))
        if self.kernel_gelu and self.act is gelu_tanh and layer_ops.usable(gate_up):
            return self.down(layer_ops.gelu_tanh_mul(gate_up, WORKERS.threads_for(0, 3 * gate_up.numel())))
        gate, up = gate_up.chunk(2, dim=-1)
        if gate.is_cpu:  # a CPU activation runs ~1.5x slower on a strided view than on a copy made first (16 rows)
            gate = gate.contiguous()
        return self.down(self.act(gate) * up)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: weight holds (1 + w) in float32; the product is rounded once, as transformers does."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


class Layer:
    def __init__(self, args: ModelArgs, index: int, get: WeightGetter, quantization: str | None = None) -> None:
        """quantization: None (weights in the loaded dtype) or "int8" (weight-only, engine/layers/linear.py)."""
        p, qz = f"model.layers.{index}", quantization

        def cat(*names: str) -> torch.Tensor:
            return fused_rows([get(f"{p}.{n}") for n in names])

        def norm(name: str) -> torch.Tensor:
            w = get(f"{p}.{name}.weight")
            return args.norm_offset + w.float() if args.gemma_norms else w.float() if args.olmo_norms else w

        attn = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
        qkv_w = get(f"{p}.self_attn.qkv_proj.weight") if args.fused_qkv else cat(*(f"{n}.weight" for n in attn))
        self.qkv = make_linear(qkv_w, cat(*(f"{n}.bias" for n in attn)) if args.qkv_bias else None, qz)
        self.o = make_linear(
            get(f"{p}.self_attn.o_proj.weight"), get(f"{p}.self_attn.o_proj.bias") if args.o_bias else None, qz
        )
        self.q_norm = norm("self_attn.q_norm") if args.qk_norm else None
        self.k_norm = norm("self_attn.k_norm") if args.qk_norm else None
        closing = args.gemma_norms or args.olmo_norms  # a norm closes each sub-block
        self.ln1 = None if args.olmo_norms else norm("input_layernorm")
        self.post_attn_norm = norm("post_attention_layernorm") if closing else None
        self.ln2 = (
            None
            if args.olmo_norms
            else norm("pre_feedforward_layernorm" if args.gemma_norms else "post_attention_layernorm")
        )
        self.post_ff_norm = norm("post_feedforward_layernorm") if closing else None
        self.mlp: GatedMLP | SparseMoE = (
            _moe(args, p, get)
            if args.moe is not None and args.moe.sparse_layers[index]
            else _dense_mlp(args, p, get, qz)
        )


def _dense_mlp(args: ModelArgs, p: str, get: WeightGetter, quantization: str | None) -> GatedMLP:
    if args.fused_qkv:  # Phi-3 fuses gate|up in the checkpoint too
        gate_up = make_linear(get(f"{p}.mlp.gate_up_proj.weight"), None, quantization)
    else:
        gate_up = make_linear(
            fused_rows([get(f"{p}.mlp.gate_proj.weight"), get(f"{p}.mlp.up_proj.weight")]),
            torch.cat([get(f"{p}.mlp.gate_proj.bias"), get(f"{p}.mlp.up_proj.bias")]) if args.mlp_bias else None,
            quantization,
        )
    down = make_linear(
        get(f"{p}.mlp.down_proj.weight"), get(f"{p}.mlp.down_proj.bias") if args.mlp_bias else None, quantization
    )
    return GatedMLP(gate_up, down, ACTIVATIONS[args.hidden_act], kernel_gelu=args.gemma_norms)


def _moe(args: ModelArgs, p: str, get: WeightGetter) -> SparseMoE:
    moe = args.moe
    assert moe is not None
    b = f"{p}.{moe.block}"
    g, u, d = moe.expert_names
    gate_up = torch.stack(
        [
            torch.cat([get(f"{b}.experts.{e}.{g}.weight"), get(f"{b}.experts.{e}.{u}.weight")])
            for e in range(moe.num_experts)
        ]
    )
    down = torch.stack([get(f"{b}.experts.{e}.{d}.weight") for e in range(moe.num_experts)])
    return SparseMoE(
        get(f"{b}.gate.weight"),
        gate_up,
        down,
        top_k=moe.top_k,
        norm_topk_prob=moe.norm_topk_prob,
        weights_in_model_dtype=moe.router_weights_in_model_dtype,
        activation=args.hidden_act,
    )


def _quantized_ends(
    embed: Any, head: Any, dtype: torch.dtype, quantization: str | None
) -> tuple[LMHead, torch.Tensor | QuantEmbedding]:
    """The LM head and embedding table where either is a GGUF model's blocks: each kept as blocks, or dense."""
    from engine.layers.quant_head import QuantHead, quant_embedding  # why late: only GGUF models kept quantized

    lm_head = QuantHead(head, dtype) if isinstance(head, GGMLWeight) else choose_head(head, quantization)
    return lm_head, quant_embedding(embed, dtype) if isinstance(embed, GGMLWeight) else embed


class CausalLM:
    """Weights plus forward; holds no per-request state (that is the KV cache the runner owns)."""

    layer_class: type[Layer] = Layer  # a family whose layers load otherwise (Gemma 4) names its own
    # per KV cache (kv heads, head dim) where layers differ or share caches (Gemma 4); None: one per layer, all alike
    kv_shapes: list[tuple[int, int]] | None = None
    logits_scaling = 1.0  # the logits divided by this (Granite's logits_scaling)
    gemma_norm_kernel = True  # Gemma's norms of bf16 CPU rows through layer_ops.cpp, as the fused decode layer's

    def __init__(
        self, args: ModelArgs, get: WeightGetter, has_lm_head: bool, max_positions: int, quantization: str | None = None
    ) -> None:
        """quantization: None (weights in the loaded dtype) or "int8" (weight-only, engine/layers/linear.py)."""
        self.args = args
        self.ops: type[TorchOps] | type[TritonOps] = TorchOps  # the runner switches to TritonOps on GPU
        embed = get("model.embed_tokens.weight")
        final = get("model.norm.weight")  # always dense, in the model's dtype (a GGUF embedding may be blocks)
        self.dtype, self.device = final.dtype, final.device
        self.layers = [self.layer_class(args, i, get, quantization) for i in range(args.num_layers)]
        self.norm = (
            args.norm_offset + final.float() if args.gemma_norms else final.float() if args.olmo_norms else final
        )
        self.tied = args.tie_word_embeddings if args.tie_word_embeddings is not None else not has_lm_head
        head_weight = embed if self.tied else get("lm_head.weight")
        self.head: LMHead
        self.embed: torch.Tensor | QuantEmbedding | None
        if isinstance(head_weight, GGMLWeight) or isinstance(embed, GGMLWeight):
            self.head, self.embed = _quantized_ends(embed, head_weight, self.dtype, quantization)
        else:
            self.head = choose_head(head_weight, quantization)
            # a tied embedding the head stores transposed is read from the head's columns: the table is stored once
            self.embed = None if self.tied and self.head.transposed is not None else embed
        del embed, head_weight
        # Gemma scales embeddings by sqrt(hidden) rounded to the model dtype, as transformers does
        self.embed_scale = torch.tensor(math.sqrt(args.hidden_size)).to(self.dtype) if args.embed_scale else None
        self.layer_windows: list[int | None] = list(args.windows)

        def table(theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
            return rope_table(args.rotary_dim, theta, scaling, max_positions, args.max_position_embeddings).to(
                self.device
            )

        self.cos_sin = table(args.rope_theta, args.rope_scaling)
        self.rope_tables = [self.cos_sin]
        if args.local_rope_theta is not None:  # Gemma 3: windowed layers turn with their own (plain) base
            self.rope_tables.append(table(args.local_rope_theta, None))
        # each layer's rope table; -1: none (a NoPE layer)
        self.layer_rope = [1 if w is not None and args.local_rope_theta is not None else 0 for w in self.layer_windows]
        self.layer_rope = [
            -1 if i < len(args.nope_layers) and args.nope_layers[i] else r for i, r in enumerate(self.layer_rope)
        ]
        self.scale = args.attn_scale if args.attn_scale is not None else args.head_dim**-0.5
        self.q_size = args.num_heads * args.head_dim
        self.kv_size = args.num_kv_heads * args.head_dim
        self.fused: FusedDecode | None = None  # decode steps in one call per layer (engine/models/fused_decode.py)
        self.fused_checked = False

    @classmethod
    def load(cls, ck: Checkpoint) -> CausalLM:
        """The model from its config.json and weights (a family with its own layout overrides this)."""
        return cls(ck.args, ck.weights, ck.has_lm_head, ck.max_positions, ck.quantization)

    def use_triton(self) -> None:
        """The GPU path: Triton attention / norm / rope kernels and the fused MoE kernel."""
        self.ops = TritonOps
        for layer in self.layers:
            if isinstance(layer.mlp, SparseMoE):
                layer.mlp.use_triton = True

    def forward(self, step: Step) -> torch.Tensor:
        """The step's input_ids, positions [T] -> hidden states [T, hidden] before the final norm."""
        x = self.embed_tokens(step.input_ids)
        if self.fused is None and not self.fused_checked:  # after the runner's choices (ops, LoRA), at first use
            self.fused, self.fused_checked = self.fused_decode(), True
        if self.fused is not None and self.fused.takes(step.meta, x.shape[0]):
            return self.fused.run(x, step.positions, step.kv_caches, step.meta)
        return self.run_layers(x, step.kv_caches, step.meta, self.rope_for(step.positions))

    def fused_decode(self) -> FusedDecode | None:
        """A FusedDecode for this model, or None when some part of it is not what the fused layer runs: another ops
        path or dtype, tensor parallel (all_reduce), LoRA or projections the kernel doesn't run, MoE, another
        activation, OLMo's norms, partial rotary. (int8 projections and GGUF blocks through the kernels it takes.)"""
        ok = (
            self.ops is TorchOps
            and self.dtype == torch.bfloat16
            and self.device.type == "cpu"
            and type(self).all_reduce is CausalLM.all_reduce
            and bool(self.layers)
            and kernels_take(self.args)
            and (not self.args.gemma_norms or self.gemma_norm_kernel)  # the norms it rounds as
        )
        norm_dtype = torch.float32 if self.args.gemma_norms else torch.bfloat16  # Gemma's: (1 + w) in float32
        for layer in self.layers if ok else []:
            mlp = layer.mlp
            ok = ok and (
                all(type(p) in FUSED_LINEARS for p in (layer.qkv, layer.o, getattr(mlp, "gate_up", None)))
                and isinstance(mlp, GatedMLP)
                and (mlp.act is F.silu or mlp.act is gelu_tanh and mlp.kernel_gelu)
                and type(mlp.down) in FUSED_LINEARS
                and (self.args.gemma_norms or layer.post_attn_norm is None)
                and (layer.post_attn_norm is None) == (layer.post_ff_norm is None)
                and all(
                    w is None or (w.dtype == norm_dtype and w.dim() == 1)
                    for w in (
                        layer.ln1,
                        layer.ln2,
                        layer.q_norm,
                        layer.k_norm,
                        layer.post_attn_norm,
                        layer.post_ff_norm,
                    )
                )
                and (layer.q_norm is None) == (layer.k_norm is None)
            )
        return FusedDecode(self) if ok else None

    def rope_for(self, positions: torch.Tensor) -> Rope:
        """The step's `rope(q, k, table)`; the torch path makes each table's factors once per step, not per layer."""
        if (
            self.ops is TorchOps
            and self.dtype == torch.bfloat16
            and self.device.type == "cpu"
            and layer_ops.available()
        ):
            halves = [rope_halves(t[positions], self.dtype) for t in self.rope_tables]  # in place, one pass each

            def rope_kernel(q: torch.Tensor, k: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
                threads = WORKERS.threads_for(0, 4 * q.numel())
                return layer_ops.rope(q, *halves[i], threads), layer_ops.rope(k, *halves[i], threads)

            return rope_kernel
        if self.ops is TorchOps:
            factors = [rope_factors(t[positions], self.dtype) for t in self.rope_tables]
            return lambda q, k, i: (rotate(q, *factors[i]), rotate(k, *factors[i]))
        return lambda q, k, i: self.ops.rope(positions, q, k, self.rope_tables[i])

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.args.gemma_norms and self.gemma_norm_kernel and weight.dtype == torch.float32 and layer_ops.usable(x):
            return layer_ops.gemma_rms_norm(x, weight, self.args.rms_norm_eps)
        if self.args.gemma_norms or self.args.olmo_norms:
            return gemma_rms_norm(x, weight, self.args.rms_norm_eps)
        return self.ops.rms_norm(x, weight, self.args.rms_norm_eps)

    def run_layers(
        self, x: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttnMetadata, rope: Rope
    ) -> torch.Tensor:
        """The decoder layers over embeddings x [T, hidden]; `rope(q, k, i)` rotates [T, heads, dims] views by
        rope table i (plain positions here, M-RoPE in engine/models/qwen2_vl.py)."""
        layers = self.layers
        normed = self.rms_norm(x, layers[0].ln1) if layers and layers[0].ln1 is not None else x
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(layers, kv_caches)):
            h = self.attention(i, layer, normed, k_cache, v_cache, meta, rope)
            x, normed = self.add_norm(x, h, layer.post_attn_norm, layer.ln2)
            h = self.all_reduce(layer.mlp(normed))
            x, normed = self.add_norm(x, h, layer.post_ff_norm, layers[i + 1].ln1 if i + 1 < len(layers) else None)
        return x

    def add_norm(
        self, x: torch.Tensor, h: torch.Tensor, post: torch.Tensor | None, then: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + h, that sum normed by `then`), h first normed by `post` (Gemma's and OLMo's closing norms); `then`
        None: the sum twice (the last layer's, whose final norm runs on the rows that sample only, or OLMo's)."""
        if post is not None:
            h = self.rms_norm(h, post)
        if then is None:
            s = x + h
            return s, s
        if self.args.gemma_norms or self.args.olmo_norms:
            s = x + h
            return s, self.rms_norm(s, then)
        return self.ops.add_rms_norm(x, h, then, self.args.rms_norm_eps)

    def attention(
        self,
        i: int,
        layer: Layer,
        h: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttnMetadata,
        rope: Rope,
    ) -> torch.Tensor:
        """One layer's attention sub-block on normed h [T, hidden] -> its output projection (all-reduced)."""
        a, t = self.args, h.shape[0]
        q, k, v = torch.split(layer.qkv(h), [self.q_size, self.kv_size, self.kv_size], dim=-1)
        if a.qk_norm_across_heads and layer.q_norm is not None and layer.k_norm is not None:
            q, k = self.rms_norm(q, layer.q_norm), self.rms_norm(k, layer.k_norm)
        q, k = q.view(t, a.num_heads, a.head_dim), k.view(t, a.num_kv_heads, a.head_dim)
        if not a.qk_norm_across_heads and layer.q_norm is not None and layer.k_norm is not None:
            q, k = self.rms_norm(q, layer.q_norm), self.rms_norm(k, layer.k_norm)
        table = self.layer_rope[i]
        if table < 0:  # a NoPE layer: q and k as projected
            pass
        elif a.rotary_dim == a.head_dim:
            q, k = rope(q, k, table)
        else:  # partial rotary: the rest of each head passes through
            r = a.rotary_dim
            q_rot, k_rot = rope(q[..., :r], k[..., :r], table)
            q, k = torch.cat([q_rot, q[..., r:]], dim=-1), torch.cat([k_rot, k[..., r:]], dim=-1)
        self.ops.write_kv(k, v.view(t, a.num_kv_heads, a.head_dim), k_cache, v_cache, meta.slot_mapping)
        out = self.ops.attention(
            q, k_cache, v_cache, meta, self.scale, window=self.layer_windows[i], softcap=a.attn_softcap
        )
        return self.all_reduce(layer.o(out.reshape(t, self.q_size)))

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel projection's partial sum -> the full one: the identity on one rank (tensor parallel:
        engine/distributed/tp_model.py sums over the ranks)."""
        return partial

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed is None:
            from_head = self.head.embedding_rows(input_ids)
            assert from_head is not None
            rows = from_head
        elif isinstance(self.embed, torch.Tensor):
            rows = F.embedding(input_ids, self.embed)
        else:  # a GGUF table kept as blocks (engine/layers/quant_linear.py QuantEmbedding)
            rows = self.embed(input_ids)
        return rows if self.embed_scale is None else rows * self.embed_scale

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.rms_norm(hidden, self.norm)

    def compute_logits(
        self,
        hidden: torch.Tensor,
        out: torch.Tensor | None = None,
        pool: ThreadPoolExecutor | None = None,
        workers: int = 1,
    ) -> torch.Tensor:
        """hidden [N, hidden] (rows from forward) -> float32 logits [N, vocab], maybe in `out` [N, vocab].

        Rounds exactly as `(h @ head).float()`: the product is in the model's dtype, then widened (and
        soft-capped, for Gemma). `pool` with `workers` > 1: that many threads (this one included) share the
        column chunks.
        """
        logits = self.head(self.final_norm(hidden), out, pool, workers)
        cap = self.args.final_softcap
        if cap is None:
            return logits if self.logits_scaling == 1.0 else logits.div_(self.logits_scaling)
        if self.dtype == torch.float32:
            return soft_cap_(logits, cap)
        # in the model's dtype, as transformers caps its logits: the same roundings, so the same ties
        return logits.copy_(soft_cap_(logits.to(self.dtype), cap))
