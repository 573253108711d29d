"""Which slice of each checkpoint tensor a tensor-parallel rank holds, read straight from safetensors.

Megatron's split: q/k/v and gate/up by output rows (columns of the activation), o and down by input
columns (their partial sums are all-reduced), embedding and LM head by vocabulary rows (padded so every
rank holds as many). Each MoE expert splits its intermediate dimension the same way (the router is whole);
fused q|k|v and gate|up tensors (Phi-3) are read as the concatenation of each part's slice. With fewer KV heads than
ranks each KV head is replicated on size / num_kv_heads
ranks: rank r's query heads all belong to KV head r * num_kv_heads // size, so it keeps only that one.
A rank reads its slices with `get_slice`, so no rank ever holds the whole model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from engine.distributed.group import TPGroup
from engine.distributed.tp_model import TPCausalLM
from engine.models.args import ModelArgs
from engine.models.weights import ModelLoadError, Weights

_LAYER = re.compile(r"model\.layers\.\d+\.(self_attn|mlp|block_sparse_moe)\.(experts\.\d+\.)?(\w+)\.(weight|bias)")


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `size`; `group` does the collectives of the model built from this shard."""

    rank: int
    size: int
    group: TPGroup | None = None

    def _split(self, n: int, what: str) -> tuple[int, int]:
        if n % self.size:
            raise ModelLoadError(f"--tensor-parallel-size {self.size} must divide the model's {what} ({n})")
        per = n // self.size
        return self.rank * per, (self.rank + 1) * per

    def heads(self, args: ModelArgs) -> tuple[int, int]:
        return self._split(args.num_heads, "attention heads")

    def kv_heads(self, args: ModelArgs) -> tuple[int, int]:
        kv = args.num_kv_heads
        if kv >= self.size:
            return self._split(kv, "KV heads")
        if self.size % kv:
            raise ModelLoadError(
                f"--tensor-parallel-size {self.size} must be a multiple of the model's {kv} KV heads to replicate them"
            )
        head = self.rank * kv // self.size
        return head, head + 1

    def intermediate(self, args: ModelArgs) -> tuple[int, int]:
        return self._split(args.intermediate_size, "intermediate size")

    def expert_intermediate(self, args: ModelArgs) -> tuple[int, int]:
        return self._split(args.moe.intermediate_size, "expert intermediate size") if args.moe else (0, 0)

    def vocab(self, args: ModelArgs) -> tuple[int, int, int]:
        """(first row, end of real rows, rows per rank): the last rank's tail is zero padding."""
        per = -(-args.vocab_size // self.size)
        start = min(self.rank * per, args.vocab_size)
        return start, min(start + per, args.vocab_size), per

    def local_args(self, args: ModelArgs) -> ModelArgs:
        """The shapes this rank's layers run with: its own query and KV heads."""
        h0, h1 = self.heads(args)
        k0, k1 = self.kv_heads(args)
        self.intermediate(args)  # refuse an unsplittable MLP before reading anything
        e0, e1 = self.expert_intermediate(args)
        moe = replace(args.moe, intermediate_size=e1 - e0) if args.moe else None
        return replace(
            args,
            num_heads=h1 - h0,
            num_kv_heads=k1 - k0,
            intermediate_size=args.intermediate_size // self.size,
            moe=moe,
        )

    def slice_rules(self, args: ModelArgs) -> tuple[dict[str, tuple[int, int, int]], dict[str, list[tuple[int, int]]]]:
        """Projection name -> (dim, start, stop) of this rank's slice (dim 0 column-parallel, 1 row-parallel); and
        the fused tensors' (Phi-3) row ranges of each part this rank holds, concatenated. LoRA slices its
        adapters by the same rules (engine/lora/manager.py)."""
        d = args.head_dim
        h0, h1 = self.heads(args)
        k0, k1 = self.kv_heads(args)
        i0, i1 = self.intermediate(args)
        rules = {
            "q_proj": (0, h0 * d, h1 * d),
            "k_proj": (0, k0 * d, k1 * d),
            "v_proj": (0, k0 * d, k1 * d),
            "o_proj": (1, h0 * d, h1 * d),
            "gate_proj": (0, i0, i1),
            "up_proj": (0, i0, i1),
            "down_proj": (1, i0, i1),
        }
        q, kv, inter = args.num_heads * d, args.num_kv_heads * d, args.intermediate_size
        fused = {
            "qkv_proj": [(h0 * d, h1 * d), (q + k0 * d, q + k1 * d), (q + kv + k0 * d, q + kv + k1 * d)],
            "gate_up_proj": [(i0, i1), (inter + i0, inter + i1)],
        }
        return rules, fused

    def weights(self, folder: Path, args: ModelArgs, dtype: torch.dtype, device: torch.device) -> ShardedWeights:
        return ShardedWeights(folder, dtype, device, self, args)

    def build(
        self, args: ModelArgs, weights: Weights, has_lm_head: bool, max_positions: int, quantization: str | None = None
    ) -> TPCausalLM:
        """The decoder on this rank's slices (`weights`), with `group` for its collectives."""
        assert self.group is not None, "a model shard needs its group for the collectives"
        return TPCausalLM(
            self.local_args(args),
            args.vocab_size,
            self.vocab(args),
            self.group,
            weights,
            has_lm_head,
            max_positions,
            quantization,
        )


class ShardedWeights(Weights):
    """Name -> this rank's slice of the tensor (the loader's getter, sliced)."""

    def __init__(self, folder: Path, dtype: torch.dtype, device: torch.device, shard: Shard, args: ModelArgs) -> None:
        super().__init__(folder, dtype, device, quiet=shard.rank != 0)  # the load is logged once, by rank 0
        self.shard, self.args = shard, args
        self._rules, self._fused = shard.slice_rules(args)
        e0, e1 = shard.expert_intermediate(args)
        self._expert_rules = {
            "gate_proj": (0, e0, e1),
            "up_proj": (0, e0, e1),
            "down_proj": (1, e0, e1),
            "w1": (0, e0, e1),
            "w3": (0, e0, e1),
            "w2": (1, e0, e1),
        }

    def _read(self, handle: Any, name: str) -> torch.Tensor:
        sl = handle.get_slice(name)
        return self._slice(name, sl, list(sl.get_shape()))

    def _slice(self, name: str, sl: Any, shape: list[int]) -> torch.Tensor:
        def get(index: Any) -> torch.Tensor:
            t: torch.Tensor = sl[index]
            return t

        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            start, end, per = self.shard.vocab(self.args)
            rows: torch.Tensor = get(slice(start, end))
            if end - start < per:  # the last rank's padding: zero rows, never sampled (trimmed after the gather)
                rows = torch.cat([rows, rows.new_zeros(per - (end - start), *shape[1:])])
            return rows
        m = _LAYER.fullmatch(name)
        proj = m.group(3) if m else ""
        if proj in self._fused:
            return torch.cat([get(slice(a, b)) for a, b in self._fused[proj]])
        rules = self._expert_rules if m and m.group(2) else self._rules
        if proj not in rules:
            return get(slice(None))  # norms, routers: every rank holds them whole
        dim, start, stop = rules[proj]
        if dim == 1 and m and m.group(4) == "bias":  # added once: by rank 0, before the all-reduce sums the ranks
            return get(slice(None)) if self.shard.rank == 0 else torch.zeros(shape)
        return get(slice(start, stop)) if dim == 0 else get((slice(None), slice(start, stop)))
