"""The decoder of engine/models/decoder.py on one tensor-parallel rank: its heads, its MLP columns, its vocabulary rows.

The layers run unchanged on local shapes (engine/distributed/sharding.py `Shard.local_args`); the three places ranks
meet are the
row-parallel projections' all-reduce (`all_reduce`), the vocabulary-parallel embedding (each rank looks up
the ids it holds, zeros elsewhere, then an all-reduce) and the LM head (each rank's columns of the
logits, gathered to rank 0, the only one that samples).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from engine.distributed.group import TPGroup
from engine.models.args import ModelArgs
from engine.models.decoder import CausalLM, WeightGetter


class TPCausalLM(CausalLM):
    def __init__(
        self,
        local_args: ModelArgs,
        vocab_size: int,
        vocab: tuple[int, int, int],
        group: TPGroup,
        weights: WeightGetter,
        has_lm_head: bool,
        max_positions: int,
        quantization: str | None = None,
    ) -> None:
        """local_args: this rank's shapes (`Shard.local_args`); vocab: its rows (`Shard.vocab`) of vocab_size."""
        self.group = group
        self.full_vocab_size = vocab_size
        self.vocab_start, vocab_end, self.vocab_rows = vocab
        self.vocab_real = vocab_end - self.vocab_start  # rows past it on this rank are padding
        super().__init__(local_args, weights, has_lm_head, max_positions, quantization)

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(partial)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.vocab_real)
        rows = super().embed_tokens(local.clamp(0, max(self.vocab_real - 1, 0)))
        return self.group.all_reduce(rows.masked_fill_(~mine[:, None], 0))

    def compute_logits(
        self,
        hidden: torch.Tensor,
        out: torch.Tensor | None = None,
        pool: ThreadPoolExecutor | None = None,
        workers: int = 1,
    ) -> torch.Tensor:
        """Rank 0: float32 logits [N, vocab] of every rank's columns; other ranks: their own columns (unused)."""
        local = super().compute_logits(hidden)  # this rank's vocabulary columns, float32
        full = self.group.gather_columns(local)
        if full is None:
            return local
        return full[:, : self.full_vocab_size]  # the last rank's padding columns must never be sampled
