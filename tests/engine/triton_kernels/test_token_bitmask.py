from __future__ import annotations

import math

import pytest
import torch

from engine.structured.bitmask import apply_token_bitmask_cpu
from engine.triton_kernels.token_bitmask import BLOCK, apply_token_bitmask, apply_token_bitmask_ref
from engine.triton_kernels.token_bitmask_ref import unpack_bitmask


def random_bitmask(rows: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    words = (vocab + 31) // 32
    return torch.randint(-(2**31), 2**31, (rows, words), dtype=torch.int64, generator=gen).to(torch.int32)


def test_unpack_matches_bit_layout() -> None:
    bm = torch.tensor([[1 - 2**31, 0b110]], dtype=torch.int32)  # bits 0 and 31, then 33 and 34
    allowed = unpack_bitmask(bm, 64)[0].nonzero()[:, 0].tolist()
    assert allowed == [0, 31, 33, 34]


@pytest.mark.parametrize("vocab", [64, 1000, BLOCK * 2 + 7, 5003])  # 1000, 2055 and 5003: not multiples of 32
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_reference(vocab: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=gen).to(dtype)
    bm = random_bitmask(3, vocab, gen)
    rows = torch.tensor([4, 0, 2])
    want = logits.clone()
    apply_token_bitmask_ref(want, bm, rows)
    got = logits.clone()
    apply_token_bitmask(got, bm, rows)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert torch.equal(got[[1, 3, 5]], logits[[1, 3, 5]])  # rows not listed are untouched
    allowed = unpack_bitmask(bm, vocab)
    assert torch.equal(torch.isinf(got[rows]), ~allowed)


def test_cpu_path_matches_reference_and_bans_uncovered_columns() -> None:
    gen = torch.Generator().manual_seed(3)
    vocab, width = 1000, 1040  # a padded head: columns past the bitmask are never allowed
    logits = torch.randn(4, width, generator=gen)
    bm = random_bitmask(2, vocab - 8, gen)  # 992 tokens: 31 words
    want = logits.clone()
    apply_token_bitmask_ref(want, bm, torch.tensor([3, 1]))
    got = logits.clone()
    apply_token_bitmask_cpu(got, bm, [3, 1])
    assert torch.equal(got, want)
    assert bool((got[[3, 1], 992:] == -math.inf).all())
    got2 = logits.clone()
    apply_token_bitmask(got2, bm, torch.tensor([3, 1]))
    assert torch.equal(got2, want)


def test_empty() -> None:
    logits = torch.randn(2, 100)
    apply_token_bitmask(logits, torch.zeros(0, 4, dtype=torch.int32), torch.zeros(0, dtype=torch.long))
    assert bool(torch.isfinite(logits).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [992, 1040, 980])  # the mask's 992 tokens; a padded head; a head narrower than it
def test_cpu_path_sparse_rows_match_reference(dtype: torch.dtype, width: int) -> None:
    """Rows allowing a few words (structural positions: kept tokens, the rest filled) mixed with dense rows."""
    gen = torch.Generator().manual_seed(width)
    logits = torch.randn(5, width, generator=gen).to(dtype)
    bm = random_bitmask(4, 992, gen)
    bm[0] = 0
    bm[0, 2] = -(2**31)  # token 95 only: bit 31, the int32 sign
    bm[2] = 0
    bm[2, [0, 30]] = torch.tensor([0b1011, -1], dtype=torch.int32)  # tokens 0, 1, 3 and 960..991 (past 980)
    bm[3] = 0  # nothing allowed
    rows = [4, 0, 1, 2]  # bitmask row i masks logits row rows[i]
    want = logits.clone()
    apply_token_bitmask_ref(want, bm, torch.tensor(rows))
    got = logits.clone()
    apply_token_bitmask_cpu(got, bm, rows)
    assert torch.equal(got, want)
    assert torch.isfinite(got[4]).nonzero()[:, 0].tolist() == [95]
    assert torch.isfinite(got[1]).nonzero()[:, 0].tolist() == [0, 1, 3, *range(960, min(width, 992))]
    assert not torch.isfinite(got[2]).any()
    assert torch.equal(got[3], logits[3])  # not listed: untouched
