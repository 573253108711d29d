from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.triton_kernels.paged_decode_attention import paged_decode_attention
from engine.triton_kernels.paged_prefill_attention import paged_prefill_attention, paged_prefill_attention_ref
from tests.engine.triton_kernels.paged_case import make_case

BS = 16
# (cached prefix, query chunk) per sequence: fresh prompts, prefix hits at and around block boundaries,
# a decode-sized chunk, and a chunk spanning several query tiles.
RAGGED = [(0, 1), (0, BS + 1), (BS, BS), (5, BS - 1), (BS - 1, 2), (3 * BS, 1), (0, 40)]


def _cu(q_lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)


def test_reference_matches_sdpa() -> None:
    case = make_case([20], kv_heads=2, head_dim=32, dtype=torch.float32)
    q = torch.randn(6, 4, 32)  # the last 6 of 20 positions; 14 are a cached prefix
    out = paged_prefill_attention_ref(q, case.k_cache, case.v_cache, case.block_tables, _cu([6]), case.seq_lens, 0.3)
    k, v = case.context(0)
    mask = torch.arange(20)[None, :] <= torch.arange(14, 20)[:, None]
    expect = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=0.3, enable_gqa=True
    ).transpose(0, 1)
    torch.testing.assert_close(out, expect, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("head_dim", "heads", "kv_heads", "dtype"),
    [(32, 2, 2, torch.float32), (64, 4, 2, torch.bfloat16), (128, 3, 1, torch.float16)],
)
def test_ragged_prefill_matches_reference(
    head_dim: int, heads: int, kv_heads: int, dtype: torch.dtype, tol: dict[torch.dtype, tuple[float, float]]
) -> None:
    q_lens = [n for _, n in RAGGED]
    case = make_case([p + n for p, n in RAGGED], kv_heads, head_dim, dtype, block_size=BS)
    q = torch.randn(sum(q_lens), heads, head_dim).to(dtype)
    args = (q, case.k_cache, case.v_cache, case.block_tables, _cu(q_lens), case.seq_lens, head_dim**-0.5)
    out = paged_prefill_attention(*args, max_query_len=max(q_lens), block_m=16)
    atol, rtol = tol[dtype]
    torch.testing.assert_close(out, paged_prefill_attention_ref(*args), atol=atol, rtol=rtol)


def test_sliding_window() -> None:
    chunks = [(0, 24), (10, 7), (30, 1)]
    q_lens = [n for _, n in chunks]
    case = make_case([p + n for p, n in chunks], kv_heads=1, head_dim=32, dtype=torch.float32, block_size=8)
    q = torch.randn(sum(q_lens), 2, 32)
    args = (q, case.k_cache, case.v_cache, case.block_tables, _cu(q_lens), case.seq_lens, 0.2)
    # 32-row tiles, 16-key steps: late rows of a tile see nothing in its first key step (the -inf guard).
    out = paged_prefill_attention(*args, max_query_len=24, sliding_window=6, block_m=32, block_n=16)
    ref = paged_prefill_attention_ref(*args, sliding_window=6)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    assert not torch.allclose(ref, paged_prefill_attention_ref(*args))  # the window mattered


def test_one_token_chunks_agree_with_decode_kernel() -> None:
    case = make_case([1, 17, 33], kv_heads=2, head_dim=64, dtype=torch.float32)
    q = torch.randn(3, 4, 64)
    prefill = paged_prefill_attention(
        q, case.k_cache, case.v_cache, case.block_tables, _cu([1, 1, 1]), case.seq_lens, 0.125, max_query_len=1
    )
    decode = paged_decode_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 0.125)
    torch.testing.assert_close(prefill, decode, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(("window", "softcap"), [(None, 1.5), (6, 1.5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softcap_and_window(
    window: int | None, softcap: float, dtype: torch.dtype, tol: dict[torch.dtype, tuple[float, float]]
) -> None:
    chunks = [(0, 24), (10, 7), (30, 1), (5, 3)]  # chunks shorter than the window cut through it
    q_lens = [n for _, n in chunks]
    case = make_case([p + n for p, n in chunks], kv_heads=1, head_dim=32, dtype=dtype, block_size=8)
    for b, (p, _) in enumerate(chunks):  # blocks every query's window has passed: released, never read
        for i in range(max(0, p - (window or p) + 1) // 8):
            case.block_tables[b, i] = -1
    q = (torch.randn(sum(q_lens), 2, 32) * 3).to(dtype)
    args = (q, case.k_cache, case.v_cache, case.block_tables, _cu(q_lens), case.seq_lens, 0.2)
    out = paged_prefill_attention(
        *args, max_query_len=24, sliding_window=window, softcap=softcap, block_m=16, block_n=16
    )
    ref = paged_prefill_attention_ref(*args, sliding_window=window, softcap=softcap)
    atol, rtol = tol[dtype]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    assert not torch.allclose(ref.float(), paged_prefill_attention_ref(*args, sliding_window=window).float(), atol=1e-2)
