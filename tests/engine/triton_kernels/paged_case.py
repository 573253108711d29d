"""A paged KV cache filled with random K/V and scattered block tables, shared by the attention tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedCase:
    k_cache: torch.Tensor  # [num_blocks, block_size, kv_heads, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [B, max_blocks], blocks in shuffled (non-contiguous) order
    seq_lens: torch.Tensor  # int32 [B]
    block_size: int

    def context(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence b's K and V [seq_len, kv_heads, D], gathered position by position."""
        n = int(self.seq_lens[b])
        rows = [
            int(self.block_tables[b, p // self.block_size]) * self.block_size + p % self.block_size for p in range(n)
        ]
        flat_k = self.k_cache.view(-1, *self.k_cache.shape[2:])
        flat_v = self.v_cache.view(-1, *self.v_cache.shape[2:])
        return flat_k[rows], flat_v[rows]


def make_case(
    seq_lens: list[int], kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int = 16, spare_blocks: int = 3
) -> PagedCase:
    need = [-(-n // block_size) for n in seq_lens]
    width = max(need) + 1  # one unused column: rows are wider than the context, as in the engine
    num_blocks = sum(need) + spare_blocks
    order = torch.randperm(num_blocks).tolist()
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    taken = 0
    for b, n in enumerate(need):
        tables[b, :n] = torch.tensor(order[taken : taken + n], dtype=torch.int32)
        taken += n
    shape = (num_blocks, block_size, kv_heads, head_dim)
    return PagedCase(
        torch.randn(shape).to(dtype),
        torch.randn(shape).to(dtype),
        tables,
        torch.tensor(seq_lens, dtype=torch.int32),
        block_size,
    )
