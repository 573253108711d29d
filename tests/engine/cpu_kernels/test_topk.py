"""engine/cpu_kernels/topk.py against torch.topk: the same values, each at a column holding it, ties in rising
column order (at the k-th place too: the earliest columns win), tails, strided rows, threads, buffers cut many
times; a row with fewer than k values above -inf is left undecided (None), as is what the kernel does not take."""

from __future__ import annotations

import math

import pytest
import torch

from engine.cpu_kernels import topk as cpu_topk

pytestmark = pytest.mark.skipif(cpu_topk._kernel() is None, reason="no AVX-512 CPU kernel here (CPU or compiler)")


def hard_rows(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, n, generator=g)
    x[1] = 0.0  # all tied: the first k columns
    x[2, n // 2 :] = 5.0  # a tie from the middle on: its first columns
    x[3, -1] = 7.0  # the tail, past the last full 16 columns
    x[4] = torch.arange(n, dtype=torch.float32)  # rising: every column passes the running threshold
    x[5] = -torch.arange(n, dtype=torch.float32)  # falling: only the first k pass
    x[6, ::3] = 2.5  # many ties above the rest
    x[7, :] = -0.0
    x[7, n - 1] = 0.0  # -0.0 == 0.0: ties by column
    return x


def expected(x: torch.Tensor, k: int) -> tuple[list[list[float]], list[list[int]]]:
    """torch.topk's values; columns ordered by (value descending, column ascending), computed independently."""
    vals, cols = [], []
    for row in x.tolist():
        order = sorted(range(len(row)), key=lambda c: (-row[c], c))[:k]
        vals.append([row[c] for c in order])
        cols.append(order)
    return vals, cols


@pytest.mark.parametrize("n", [1, 15, 16, 17, 64, 65, 1000, 5003])
@pytest.mark.parametrize("k", [1, 2, 40, 64])
@pytest.mark.parametrize("threads", [1, 2])
def test_topk_is_torch_topk_with_ties_by_column(n: int, k: int, threads: int) -> None:
    if k > n:
        k = n
    x = hard_rows(n, n + k)
    got = cpu_topk.topk(x, k, threads)
    assert got is not None and got[0].dtype == torch.float32 and got[1].dtype == torch.int64
    assert torch.equal(got[0], x.topk(k, dim=-1).values)
    want_vals, want_cols = expected(x, k)
    assert got[0].tolist() == want_vals and got[1].tolist() == want_cols


def test_a_vocabulary_sized_row() -> None:
    x = hard_rows(262_144, 3)[:3]
    got = cpu_topk.topk(x, 64, 2)
    assert got is not None
    assert torch.equal(got[0], x.topk(64, dim=-1).values)
    assert torch.equal(x.gather(1, got[1]), got[0])


def test_strided_rows() -> None:
    wide = hard_rows(300, 1)
    view = wide[:, :250]  # a padded head's logits, trimmed to the vocabulary
    got = cpu_topk.topk(view, 5, 2)
    assert got is not None and got[0].tolist() == expected(view, 5)[0] and got[1].tolist() == expected(view, 5)[1]
    every_other = wide[::2]
    got = cpu_topk.topk(every_other, 3)
    assert got is not None and got[1].tolist() == expected(every_other, 3)[1]


@pytest.mark.parametrize("finite", [0, 1, 3, 4])
def test_too_few_values_above_minus_inf_leave_the_rows_undecided(finite: int) -> None:
    x = torch.randn(3, 100)
    x[1, finite:] = -math.inf
    got = cpu_topk.topk(x, 4, 2)
    assert (got is None) == (finite < 4)
    assert cpu_topk.topk(x[2:], 4) is not None  # the other rows alone are decided


def test_what_the_kernel_does_not_take() -> None:
    x = torch.randn(2, 50)
    assert cpu_topk.topk(x.double(), 3) is None
    assert cpu_topk.topk(x.t(), 3) is None  # columns not contiguous
    assert cpu_topk.topk(x, 0) is None and cpu_topk.topk(x, 51) is None
    assert cpu_topk.topk(x[:0], 3) is None
