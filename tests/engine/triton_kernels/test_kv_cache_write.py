from __future__ import annotations

import pytest
import torch

from engine.triton_kernels.kv_cache_write import write_kv_cache, write_kv_cache_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 128])
def test_scatter_matches_reference(
    dtype: torch.dtype, head_dim: int, tol: dict[torch.dtype, tuple[float, float]]
) -> None:
    blocks, block_size, kv_heads, t = 6, 16, 2, 10
    kv = torch.randn(t, 2 * kv_heads * head_dim).to(dtype)  # k and v as strided views of one buffer
    k = kv[:, : kv_heads * head_dim].view(t, kv_heads, head_dim)
    v = kv[:, kv_heads * head_dim :].view(t, kv_heads, head_dim)
    slots = torch.randperm(blocks * block_size)[:t]
    slots[3] = -1  # padding token: skipped
    caches = [torch.randn(blocks, block_size, kv_heads, head_dim).to(dtype) for _ in range(2)]
    expect = [c.clone() for c in caches]
    write_kv_cache(k, v, caches[0], caches[1], slots)
    write_kv_cache_ref(k, v, expect[0], expect[1], slots)
    assert torch.equal(caches[0], expect[0]) and torch.equal(caches[1], expect[1])
    flat = caches[0].view(-1, kv_heads, head_dim)
    assert torch.equal(flat[slots[0]], k[0]) and torch.equal(flat[slots[9]], k[9])


def test_flat_cache_layout() -> None:
    k, v = torch.randn(3, 1, 64), torch.randn(3, 1, 64)
    kc, vc = torch.zeros(32, 1, 64), torch.zeros(32, 1, 64)
    write_kv_cache(k, v, kc, vc, torch.tensor([31, 0, 16]))
    assert torch.equal(kc[[31, 0, 16]], k) and torch.equal(vc[[31, 0, 16]], v)
    assert kc[1:16].abs().sum() == 0
