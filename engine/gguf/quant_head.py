"""The LM head and the embedding table of a GGUF model whose weights stay the file's quantized blocks on CPU
(engine/layers/quant_linear.py computes on them); the decoder builds these where its weights are GGMLWeight."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from engine.gguf.tensor import GGMLWeight
from engine.layers.lm_head import LMHead
from engine.layers.quant_linear import QuantEmbedding, make_quant_linear


class QuantHead(LMHead):
    """LMHead's interface over blocks: float32 logits [N, vocab], rounded as `(h @ W.T).float()` in h's dtype."""

    def __init__(self, weight: GGMLWeight, dtype: torch.dtype) -> None:  # noqa: PLW0231 - LMHead's packs a tensor
        self.vocab = weight.shape[0]
        self.dtype = dtype
        self.linear = make_quant_linear(weight, None, dtype)
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
    return QuantEmbedding(weight, dtype)
