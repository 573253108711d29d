"""Hybrid decoders: attention layers over the paged KV cache mixed with recurrent layers that keep a fixed-size
state per sequence (engine/models/recurrent/, engine/execution/recurrent_state.py).

Each layer is a pre-norm token mixer (attention, or a recurrent mixer reading and advancing its state at the
sequence's slot) and a pre-norm gated MLP, both residual. Only the attention layers hold KV; the runner
allocates the state pool beside it. Attention may gate its output per channel (Qwen3.5: sigmoid of a second
half of q_proj) and turn only part of each head (partial rotary). A family module builds the blocks from its
checkpoint's names (engine/models/lfm2.py, engine/models/qwen3_5.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, Self

import torch

from engine.gguf.tensor import GGMLWeight
from engine.layers.linear import Linear, make_linear
from engine.layers.lm_head import choose_head
from engine.layers.moe import ACTIVATIONS
from engine.layers.ops import AttnMetadata, TorchOps
from engine.models.args import ModelArgs
from engine.models.decoder import (
    CausalLM,
    Checkpoint,
    GatedMLP,
    Rope,
    WeightSource,
    _quantized_ends,
    fused_rows,
    gemma_rms_norm,
)
from engine.models.recurrent.state import StateBatch, StateShape
from engine.models.rope import rope_table
from engine.models.step import Step


class MLP(Protocol):
    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class Mixer(Protocol):
    def state_shapes(self, dtype: torch.dtype) -> list[StateShape]: ...

    def __call__(self, h: torch.Tensor, state: tuple[torch.Tensor, ...], sb: StateBatch) -> torch.Tensor: ...


@dataclass
class AttnBlock:
    qkv: Linear  # q | k | v fused
    o: Linear
    q_norm: torch.Tensor | None  # per-head RMSNorm weights
    k_norm: torch.Tensor | None
    gate: Linear | None  # output gate: attention output times sigmoid(gate(h)) before o (Qwen3.5)
    ln1: torch.Tensor
    ln2: torch.Tensor
    mlp: MLP


@dataclass
class RecurrentBlock:
    mixer: Mixer
    ln1: torch.Tensor
    ln2: torch.Tensor
    mlp: MLP


Block = AttnBlock | RecurrentBlock


@dataclass(frozen=True)
class Ends:
    """The parts around the blocks: embedding, final norm weight and the LM head's weight (None: tied)."""

    embed: torch.Tensor
    norm: torch.Tensor
    head: torch.Tensor | None
    dtype: torch.dtype | None = None  # the checkpoint's dtype where the norm is kept in another (Qwen3.5: float32)


BlockLoader = Callable[[ModelArgs, int, WeightSource, str | None], Block]  # (args, layer index, weights, quantization)


def gated_mlp(args: ModelArgs, get: WeightSource, qz: str | None, gate: str, up: str, down: str) -> GatedMLP:
    """A bias-free gated MLP from its projections' weight names (gate and up fused into one product)."""
    return GatedMLP(
        make_linear(fused_rows([get(gate), get(up)]), None, qz),
        make_linear(get(down), None, qz),
        ACTIVATIONS[args.hidden_act],
    )


class HybridLM(CausalLM):
    """Subclasses give `load`; norms (1 + w) in float32 where args.gemma_norms (Qwen3.5), else plain."""

    def __init__(
        self, args: ModelArgs, blocks: list[Block], ends: Ends, max_positions: int, quantization: str | None
    ) -> None:
        self.args = args
        self.ops = TorchOps
        # the norm: always dense (a GGUF table: blocks); the KV cache and the states take this dtype
        self.dtype, self.device = ends.dtype or ends.norm.dtype, ends.norm.device
        self.blocks = blocks
        self.layers = []  # the plain decoder's layers: none (no fused decode, no LoRA)
        self.kv_index = {i: n for n, i in enumerate(i for i, b in enumerate(blocks) if isinstance(b, AttnBlock))}
        recurrent = [i for i, b in enumerate(blocks) if isinstance(b, RecurrentBlock)]
        self.state_index = {i: n for n, i in enumerate(recurrent)}
        self.norm = ends.norm
        self.tied = ends.head is None
        head = ends.embed if ends.head is None else ends.head
        if isinstance(head, GGMLWeight) or isinstance(ends.embed, GGMLWeight):  # a GGUF file's blocks
            self.head, self.embed = _quantized_ends(ends.embed, head, self.dtype, quantization)
        else:
            self.head = choose_head(head, quantization)
            self.embed = None if self.tied and self.head.transposed is not None else ends.embed
        self.embed_scale = None
        self.layer_windows = [None] * args.num_layers
        self.cos_sin = rope_table(
            args.rotary_dim, args.rope_theta, args.rope_scaling, max_positions, args.max_position_embeddings
        ).to(self.device)
        self.rope_tables = [self.cos_sin]
        self.layer_rope = [0] * args.num_layers
        self.scale = args.head_dim**-0.5
        self.q_size = args.num_heads * args.head_dim
        self.kv_size = args.num_kv_heads * args.head_dim
        self.fused, self.fused_checked = None, True
        self.residual_scale = 1.0  # each sub-block's output times this before the residual add (Granite)
        self.embedding_multiplier = 1.0  # Granite's multipliers (engine/models/granite_hybrid.py)
        self.turns = True  # rope on the attention layers (Granite 4.0-H may leave positions to its Mamba layers)

    @classmethod
    def from_blocks(
        cls,
        ck: Checkpoint,
        block: BlockLoader,
        norm_name: str,
        norm: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> Self:
        """The model from a family's block loader and its final norm's weight name (`norm`: how it is stored)."""
        weights = ck.weights
        blocks = [block(ck.args, i, weights, ck.quantization) for i in range(ck.args.num_layers)]
        embed, final = weights("model.embed_tokens.weight"), weights(norm_name)
        ends = Ends(embed, final if norm is None else norm(final), ck.lm_head(), final.dtype)
        return cls(ck.args, blocks, ends, ck.max_positions, ck.quantization)

    @property
    def num_kv_layers(self) -> int:
        return len(self.kv_index)

    def state_shapes(self) -> list[list[StateShape]]:
        """Per recurrent layer (model order), its state tensors' per-sequence shapes."""
        return [b.mixer.state_shapes(self.dtype) for b in self.blocks if isinstance(b, RecurrentBlock)]

    def use_triton(self) -> None:
        from engine.layers.ops import TritonOps  # why late: as the plain decoder, the GPU path only

        self.ops = TritonOps

    def fused_decode(self) -> None:
        return None

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.args.gemma_norms:
            return gemma_rms_norm(x, weight, self.args.rms_norm_eps)
        return self.ops.rms_norm(x, weight, self.args.rms_norm_eps)

    def forward(self, step: Step) -> torch.Tensor:
        """The step's input_ids, positions [T] and recurrent states -> hidden states [T, hidden] before the norm."""
        states = step.states
        assert states is not None, "a hybrid model runs with its recurrent states"
        x = self.embed_tokens(step.input_ids)
        rope = self.rope_for(step.positions)
        blocks = self.blocks
        normed = self.rms_norm(x, blocks[0].ln1)
        for i, b in enumerate(blocks):
            if isinstance(b, AttnBlock):
                h = self.attend(i, b, normed, step.kv_caches[self.kv_index[i]], step.meta, rope)
            else:
                h = b.mixer(normed, states.layers[self.state_index[i]], states)
            x = self.residual(x, h)
            x = self.residual(x, b.mlp(self.rms_norm(x, b.ln2)))
            normed = self.rms_norm(x, blocks[i + 1].ln1) if i + 1 < len(blocks) else x
        return x

    def residual(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return x + h if self.residual_scale == 1.0 else x + h * self.residual_scale

    def attend(
        self,
        i: int,
        b: AttnBlock,
        h: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttnMetadata,
        rope: Rope,
    ) -> torch.Tensor:
        """One attention layer on normed h [T, hidden]: q/k norms, (partial) rope, paged KV, gate, o."""
        a, t = self.args, h.shape[0]
        q, k, v = torch.split(b.qkv(h), [self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = q.reshape(t, a.num_heads, a.head_dim), k.reshape(t, a.num_kv_heads, a.head_dim)
        if b.q_norm is not None and b.k_norm is not None:
            q, k = self.rms_norm(q, b.q_norm), self.rms_norm(k, b.k_norm)
        r = a.rotary_dim
        if not self.turns:
            pass
        elif r == a.head_dim:
            q, k = rope(q, k, 0)
        else:  # partial rotary: the rest of each head passes through
            q_rot, k_rot = rope(q[..., :r], k[..., :r], 0)
            q, k = torch.cat([q_rot, q[..., r:]], dim=-1), torch.cat([k_rot, k[..., r:]], dim=-1)
        k_cache, v_cache = cache
        self.ops.write_kv(k, v.reshape(t, a.num_kv_heads, a.head_dim), k_cache, v_cache, meta.slot_mapping)
        out = self.ops.attention(q, k_cache, v_cache, meta, self.scale, window=None, softcap=None).reshape(t, -1)
        if b.gate is not None:
            out = out * torch.sigmoid(b.gate(h))
        return b.o(out)
