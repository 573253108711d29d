"""What a model's forward reads for one step (engine/execution/model_runner.py builds it): the flat batch over the
paged KV cache, and what one family needs beside it (a hybrid model's recurrent states, Whisper's cross-attention
K/V, a vision model's rows with the images spliced in)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.layers.ops import AttnMetadata
from engine.models.recurrent.state import StateBatch


@dataclass
class CrossKV:
    """One request's cross-attention keys and values: per decoder layer, K and V [heads, frames, head_dim]."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for k, _ in self.layers)


@dataclass
class CrossBatch:
    """The step's cross-attention inputs: per sequence in batch order, its rows [start, start + n) and its K/V."""

    spans: list[tuple[int, int, CrossKV]]


@dataclass(frozen=True)
class Step:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]; [3, T] in a vision model's step with images (M-RoPE)
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per KV cache: (K, V)
    meta: AttnMetadata
    states: StateBatch | None = None  # a hybrid model's: its recurrent layers read and advance them
    cross: CrossBatch | None = None  # Whisper's: every request's encoded audio
    embeds: torch.Tensor | None = None  # a vision model's [T, hidden] rows, in place of the token embedding
