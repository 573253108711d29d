"""One decoder for Llama, Qwen2 and Mistral checkpoints over a paged KV cache.

The three differ only in config: Qwen2 has q/k/v biases, Mistral may use a sliding window,
Llama 3 scales its rotary frequencies. Weights are fused at load (q|k|v, gate|up) so each layer
runs four matmuls.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from engine.attention import AttnMetadata, TorchOps, TritonOps, apply_rope, rope_cos_sin, rope_inv_freq
from engine.layers.linear import make_linear
from engine.layers.lm_head import LMHead

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


class ConfigError(ValueError):
    """config.json describes something this implementation cannot run."""


@dataclass(frozen=True)
class ModelArgs:
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool | None  # None: config.json does not say
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_window: int | None  # one window for every layer, or None

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArgs:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ConfigError(f"architecture {archs or 'unknown'} is not supported; "
                              f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act {cfg['hidden_act']!r} is not supported; only silu is")
        heads = int(cfg["num_attention_heads"])
        # transformers 5 nests rope settings under rope_parameters; older configs keep them top level.
        rope = dict(cfg.get("rope_parameters") or {})
        theta = float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        scaling = cfg.get("rope_scaling") or rope or None
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if rope_type == "default":
            scaling = None
        elif rope_type not in ("linear", "llama3"):
            raise ConfigError(f"rope_type {rope_type!r} is not supported; supported: default, linear, llama3")
        is_llama = arch == "LlamaForCausalLM"
        return cls(
            architecture=arch,
            hidden_size=int(cfg["hidden_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=cfg.get("tie_word_embeddings"),
            qkv_bias=arch == "Qwen2ForCausalLM" or (is_llama and bool(cfg.get("attention_bias"))),
            o_bias=is_llama and bool(cfg.get("attention_bias")),
            mlp_bias=is_llama and bool(cfg.get("mlp_bias")),
            sliding_window=_sliding_window(arch, cfg),
        )


def _sliding_window(arch: str, cfg: dict[str, Any]) -> int | None:
    window = cfg.get("sliding_window")
    if arch == "MistralForCausalLM":
        return int(window) if window else None
    if arch == "Qwen2ForCausalLM" and cfg.get("use_sliding_window") and window:
        types = cfg.get("layer_types") or []
        if types and set(types) != {"sliding_attention"}:
            raise ConfigError("Qwen2 with sliding window on some layers only is not supported; "
                              "set use_sliding_window to false in config.json")
        return int(window)
    return None


WeightGetter = Callable[[str], torch.Tensor]


class Layer:
    def __init__(self, args: ModelArgs, prefix: str, get: WeightGetter, quantization: str | None = None) -> None:
        def cat(*names: str) -> torch.Tensor:
            return torch.cat([get(f"{prefix}.{n}") for n in names], dim=0)

        attn = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
        q = quantization
        self.qkv = make_linear(cat(*(f"{n}.weight" for n in attn)),
                               cat(*(f"{n}.bias" for n in attn)) if args.qkv_bias else None, q)
        self.o = make_linear(get(f"{prefix}.self_attn.o_proj.weight"),
                             get(f"{prefix}.self_attn.o_proj.bias") if args.o_bias else None, q)
        self.gate_up = make_linear(cat("mlp.gate_proj.weight", "mlp.up_proj.weight"),
                                   cat("mlp.gate_proj.bias", "mlp.up_proj.bias") if args.mlp_bias else None, q)
        self.down = make_linear(get(f"{prefix}.mlp.down_proj.weight"),
                                get(f"{prefix}.mlp.down_proj.bias") if args.mlp_bias else None, q)
        self.ln1 = get(f"{prefix}.input_layernorm.weight")
        self.ln2 = get(f"{prefix}.post_attention_layernorm.weight")


class CausalLM:
    """Weights plus forward; holds no per-request state (that is the KV cache the runner owns)."""

    def __init__(self, args: ModelArgs, get: WeightGetter, has_lm_head: bool, max_positions: int,
                 quantization: str | None = None) -> None:
        """quantization: None (weights in the loaded dtype) or "int8" (weight-only, engine/layers/linear.py)."""
        self.args = args
        self.ops: type[TorchOps] | type[TritonOps] = TorchOps  # the runner switches to TritonOps on GPU
        embed = get("model.embed_tokens.weight")
        self.dtype, self.device = embed.dtype, embed.device
        self.layers = [Layer(args, f"model.layers.{i}", get, quantization) for i in range(args.num_layers)]
        # each layer's sliding window (None: full attention); families with local/global layers set their own
        self.layer_windows: list[int | None] = [args.sliding_window] * args.num_layers
        self.norm = get("model.norm.weight")
        self.tied = args.tie_word_embeddings if args.tie_word_embeddings is not None else not has_lm_head
        self.head = LMHead(embed if self.tied else get("lm_head.weight"), quantization)
        # a tied embedding the head stores transposed is read from the head's columns: the table is stored once
        self.embed: torch.Tensor | None = None if self.tied and self.head.transposed is not None else embed
        del embed
        inv_freq = rope_inv_freq(args.head_dim, args.rope_theta, args.rope_scaling)
        self.cos_sin = rope_cos_sin(inv_freq, max_positions).to(self.device)
        self.scale = args.head_dim ** -0.5
        self.q_size = args.num_heads * args.head_dim
        self.kv_size = args.num_kv_heads * args.head_dim

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttnMetadata) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden] before the final norm."""
        return self.run_layers(self.embed_tokens(input_ids), kv_caches, meta, self.rope_for(positions))

    def rope_for(self, positions: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor],
                                                            tuple[torch.Tensor, torch.Tensor]]:
        """The step's `rope(q, k)`; the torch path gathers the table's rows once per step, not once per layer."""
        if self.ops is TorchOps:
            rows = self.cos_sin[positions]
            return lambda q, k: (apply_rope(q, rows), apply_rope(k, rows))
        return lambda q, k: self.ops.rope(positions, q, k, self.cos_sin)

    def run_layers(self, x: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttnMetadata,
                   rope: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """The decoder layers over embeddings x [T, hidden]; `rope(q, k)` rotates [T, heads, head_dim] views
        (plain positions here, M-RoPE in engine/models/qwen2_vl.py)."""
        a, ops = self.args, self.ops
        t = x.shape[0]
        for layer, window, (k_cache, v_cache) in zip(self.layers, self.layer_windows, kv_caches):
            h = ops.rms_norm(x, layer.ln1, a.rms_norm_eps)
            qkv = layer.qkv(h)
            q, k, v = qkv.split_with_sizes([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q, k = rope(q.view(t, a.num_heads, a.head_dim), k.view(t, a.num_kv_heads, a.head_dim))
            ops.write_kv(k, v.view(t, a.num_kv_heads, a.head_dim), k_cache, v_cache, meta.slot_mapping)
            attn = ops.attention(q, k_cache, v_cache, meta, self.scale, window=window)
            x = x + self.all_reduce(layer.o(attn.reshape(t, self.q_size)))
            h = ops.rms_norm(x, layer.ln2, a.rms_norm_eps)
            gate, up = layer.gate_up(h).chunk(2, dim=-1)
            x = x + self.all_reduce(layer.down(F.silu(gate) * up))
        return x

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel projection's partial sum -> the full one: the identity on one rank (tensor parallel:
        engine/distributed/tp_model.py sums over the ranks)."""
        return partial

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed is None:
            rows = self.head.embedding_rows(input_ids)
            assert rows is not None
            return rows
        return F.embedding(input_ids, self.embed)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None,
                       pool: ThreadPoolExecutor | None = None, workers: int = 1) -> torch.Tensor:
        """hidden [N, hidden] (rows from forward) -> float32 logits [N, vocab], maybe in `out` [N, vocab].

        Rounds exactly as `(h @ head).float()`: the product is in the model's dtype, then widened.
        `pool` with `workers` > 1: that many threads (this one included) share the column chunks.
        """
        h = self.ops.rms_norm(hidden, self.norm, self.args.rms_norm_eps)
        return self.head(h, out, pool, workers)
