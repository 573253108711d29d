from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.triton_kernels.paged_decode_attention import (
    choose_num_splits,
    paged_decode_attention,
    paged_decode_attention_ref,
)
from tests.engine.triton_kernels.paged_case import make_case

BS = 16
# Context lengths at the block boundaries: 1, block_size - 1, block_size, block_size + 1, several blocks.
EDGE_LENS = [1, BS - 1, BS, BS + 1, 3 * BS + 5]


def test_reference_matches_sdpa() -> None:
    case = make_case([9, 40], kv_heads=2, head_dim=64, dtype=torch.float32)
    q = torch.randn(2, 8, 64)
    out = paged_decode_attention_ref(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 0.125)
    for b in range(2):
        k, v = case.context(b)
        expect = F.scaled_dot_product_attention(
            q[b][:, None], k.transpose(0, 1), v.transpose(0, 1), scale=0.125, enable_gqa=True
        )[:, 0]
        torch.testing.assert_close(out[b], expect, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("head_dim", "heads", "kv_heads", "dtype"),
    [
        (16, 4, 2, torch.float32),  # the test checkpoints' head_dim
        (32, 4, 4, torch.float32),  # no GQA
        (64, 8, 2, torch.bfloat16),  # GQA group 4
        (128, 8, 1, torch.float16),  # multi-query
        (64, 6, 2, torch.float32),  # group 3: not a power of two
    ],
)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_matches_reference(
    head_dim: int,
    heads: int,
    kv_heads: int,
    dtype: torch.dtype,
    num_splits: int,
    tol: dict[torch.dtype, tuple[float, float]],
) -> None:
    case = make_case(EDGE_LENS, kv_heads, head_dim, dtype, block_size=BS)
    q = torch.randn(len(EDGE_LENS), heads, head_dim).to(dtype)
    scale = head_dim**-0.5
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, scale)
    atol, rtol = tol[dtype]
    torch.testing.assert_close(
        paged_decode_attention(*args, num_splits=num_splits), paged_decode_attention_ref(*args), atol=atol, rtol=rtol
    )


def test_sliding_window_and_flat_cache_layout() -> None:
    block_size = 8
    case = make_case([3, 8, 9, 30], kv_heads=2, head_dim=32, dtype=torch.float32, block_size=block_size)
    q = torch.randn(4, 4, 32)
    flat_k = case.k_cache.view(-1, 2, 32)
    flat_v = case.v_cache.view(-1, 2, 32)
    args = (q, flat_k, flat_v, case.block_tables, case.seq_lens, 0.2)
    for splits in (1, 2):
        out = paged_decode_attention(*args, block_size=block_size, sliding_window=5, num_splits=splits)
        ref = paged_decode_attention_ref(*args, block_size=block_size, sliding_window=5)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    # The window must change something, or this test checks nothing beyond the plain case.
    full = paged_decode_attention_ref(*args, block_size=block_size)
    assert not torch.allclose(full[3], ref[3]) and torch.allclose(full[0], ref[0])


@pytest.mark.parametrize("num_splits", [1, 8])
def test_more_splits_than_keys_padding_rows_and_strided_query(num_splits: int) -> None:
    case = make_case([1, 0, 2, 70], kv_heads=1, head_dim=64, dtype=torch.float32)  # seq_len 0: a padding row
    qkv = torch.randn(4, 6 * 64)
    q = qkv[:, : 4 * 64].view(4, 4, 64)  # a view into a fused projection, row stride 384
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 0.125)
    out = paged_decode_attention(*args, num_splits=num_splits)
    torch.testing.assert_close(out, paged_decode_attention_ref(*args), atol=2e-5, rtol=2e-5)
    assert torch.equal(out[1], torch.zeros(4, 64))


def test_split_heuristic() -> None:
    assert choose_num_splits(64, 8, 1024) == 1  # 512 programs already fill the GPU
    assert choose_num_splits(1, 8, 4096) == 16  # a lone long sequence is split up
    assert choose_num_splits(1, 8, 100) == 1  # too short to be worth a merge


@pytest.mark.parametrize(("window", "softcap"), [(None, 2.0), (7, 2.0), (7, None)])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softcap_and_window(
    window: int | None,
    softcap: float | None,
    num_splits: int,
    dtype: torch.dtype,
    tol: dict[torch.dtype, tuple[float, float]],
) -> None:
    case = make_case(EDGE_LENS, kv_heads=2, head_dim=32, dtype=dtype, block_size=BS)
    q = (torch.randn(len(EDGE_LENS), 6, 32) * 3).to(dtype)  # large scores, so the cap bites
    # blocks before every window are released by the block manager: poison them, they must not be read
    for b, n in enumerate(EDGE_LENS):
        for i in range(max(0, n - (window or n)) // BS):
            case.block_tables[b, i] = -1
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 0.2)
    out = paged_decode_attention(*args, sliding_window=window, softcap=softcap, num_splits=num_splits)
    ref = paged_decode_attention_ref(*args, sliding_window=window, softcap=softcap)
    atol, rtol = tol[dtype]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    plain = paged_decode_attention_ref(*args, sliding_window=window)
    assert softcap is None or not torch.allclose(plain, ref, atol=1e-2)  # the cap changed something


def test_softcap_tanh_saturates_without_nan() -> None:
    case = make_case([40], kv_heads=1, head_dim=16, dtype=torch.float32)
    q = torch.randn(1, 2, 16) * 1e4  # scores far past exp's range: tanh must saturate to +-1
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 1.0)
    out = paged_decode_attention(*args, softcap=5.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, paged_decode_attention_ref(*args, softcap=5.0), atol=2e-5, rtol=2e-5)
