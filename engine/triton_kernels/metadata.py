"""The per-step tensors the paged-attention kernels read, built once per step and shared by all layers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PagedBatch:
    block_tables: torch.Tensor  # int32 [B, max_blocks], rows padded with block 0 (never read past seq_lens)
    seq_lens: torch.Tensor  # int32 [B] context length of each sequence including this step's tokens
    cu_seqlens_q: torch.Tensor  # int32 [B + 1] row offsets of each sequence's query chunk in the flat batch
    max_query_len: int
    max_seq_len: int


def build_paged_batch(block_tables: Sequence[Sequence[int]], seq_lens: Sequence[int], query_lens: Sequence[int],
                      block_size: int, device: torch.device | str) -> PagedBatch:
    """Host lists -> device tensors in one copy each; only the blocks the contexts use are kept."""
    if not (len(block_tables) == len(seq_lens) == len(query_lens)):
        raise ValueError("block_tables, seq_lens and query_lens need one entry per sequence")
    max_seq = max(seq_lens, default=0)
    width = max(-(-max_seq // block_size), 1)
    rows = [list(t[:width]) + [0] * (width - len(t[:width])) for t in block_tables]
    cu = [0]
    for n in query_lens:
        cu.append(cu[-1] + n)
    return PagedBatch(
        block_tables=torch.tensor(rows, dtype=torch.int32).view(len(rows), width).to(device, non_blocking=True),
        seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32).to(device, non_blocking=True),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32).to(device, non_blocking=True),
        max_query_len=max(query_lens, default=0),
        max_seq_len=max_seq,
    )
