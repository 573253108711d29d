"""The LM head and the embedding table of a GGUF model whose weights stay the file's quantized blocks on CPU
(engine/layers/quant_linear.py computes on them); the decoder builds these where its weights are GGMLWeight."""

from __future__ import annotations

import weakref
from concurrent.futures import ThreadPoolExecutor

import torch

from engine.gguf.tensor import GGMLWeight
from engine.layers.lm_head import LMHead
from engine.layers.quant_linear import QuantEmbedding, QuantLinear, make_quant_linear

# heads by id of the blocks they were made from, while they live: a tied embedding made from the same blocks reads
# its rows from the head's packed form (engine/cpu_kernels/quant_dot.py) rather than keeping the blocks twice
_HEADS: weakref.WeakValueDictionary[int, QuantLinear] = weakref.WeakValueDictionary()


class QuantHead(LMHead):
    """LMHead's interface over blocks: float32 logits [N, vocab], rounded as `(h @ W.T).float()` in h's dtype."""

    def __init__(self, weight: GGMLWeight, dtype: torch.dtype) -> None:  # noqa: PLW0231 - LMHead's packs a tensor
        self.vocab = weight.shape[0]
        self.dtype = dtype
        self.linear = make_quant_linear(weight, None, dtype)
        if isinstance(self.linear, QuantLinear):
            self.linear.made_from = weakref.ref(weight.data)
            _HEADS[id(weight.data)] = self.linear
        self.transposed = None  # a tied embedding is never read from this head's columns
        self.fills_out = True
        self.form, self.chunks, self.packed, self.weight = "ggml", [], None, None

    def embedding_rows(self, ids: torch.Tensor) -> torch.Tensor | None:
        return None

    def __call__(
        self, h: torch.Tensor, out: torch.Tensor | None = None, pool: ThreadPoolExecutor | None = None, workers: int = 1
    ) -> torch.Tensor:
        """pool and workers: unused (the quantized kernels share the rows over their own threads)."""
        logits = self.linear(h).float()
        if out is None:
            return logits
        out[: logits.shape[0]].copy_(logits)
        return out[: logits.shape[0]]


def quant_embedding(weight: GGMLWeight, dtype: torch.dtype) -> QuantEmbedding:
    """The table of `weight`: from a live head's packed form where that head was made from these very blocks."""
    head = _HEADS.get(id(weight.data))
    if head is not None and head.made_from is not None and head.made_from() is weight.data:
        return QuantEmbedding(weight, dtype, head)
    return QuantEmbedding(weight, dtype)
