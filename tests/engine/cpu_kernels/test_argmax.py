"""engine/cpu_kernels/argmax.py against torch.argmax: the first maximal column, ties inside and across the
kernel's lanes and chains, tails, strided rows, threads; rows holding a NaN, +inf or nothing finite are left
undecided (None), as is what the kernel does not take."""

from __future__ import annotations

import math

import pytest
import torch

from engine.cpu_kernels import argmax as cpu_argmax

pytestmark = pytest.mark.skipif(cpu_argmax._kernel() is None, reason="no AVX-512 CPU kernel here (CPU or compiler)")


def hard_rows(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(9, n, generator=g)
    x[1] = 0.0  # all tied: column 0
    x[2, n // 2 :] = 5.0  # a tie from the middle on: its first column
    x[3, -1] = 7.0  # the tail, past the unrolled loop
    x[4, 0] = 7.0  # the first column
    x[5, :] = -math.inf
    x[5, n // 3] = -1e30  # one finite value among -inf
    if n > 17:
        x[6, 17] = x[6, 16] = 3.0  # adjacent lanes
        x[7, n - 1] = x[7, 1] = 4.0  # the same value in two chains: the earlier
    x[8, :] = -0.0
    x[8, n - 1] = 0.0  # -0.0 == 0.0: column 0
    return x


@pytest.mark.parametrize("n", [1, 15, 16, 17, 63, 64, 65, 129, 1000, 151_936])
@pytest.mark.parametrize("threads", [1, 2])
def test_argmax_is_torch_argmax(n: int, threads: int) -> None:
    x = hard_rows(n, n)
    got = cpu_argmax.argmax(x, threads)
    assert got is not None and got.dtype == torch.int64
    assert got.tolist() == x.argmax(-1).tolist()


def test_strided_rows_and_a_single_row() -> None:
    wide = hard_rows(300, 1)
    view = wide[:, :250]  # a padded head's logits, trimmed to the vocabulary
    assert cpu_argmax.argmax(view, 2).tolist() == view.argmax(-1).tolist()  # type: ignore[union-attr]
    every_other = wide[::2]
    assert cpu_argmax.argmax(every_other).tolist() == every_other.argmax(-1).tolist()  # type: ignore[union-attr]
    assert cpu_argmax.argmax(wide[3:4], 2).tolist() == [299]  # type: ignore[union-attr]


@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize("at", [0, 16, 63, 64, 200])
def test_a_nan_or_inf_anywhere_leaves_the_rows_undecided(bad: float, at: int) -> None:
    x = torch.randn(4, 203)
    x[2, at] = bad
    assert cpu_argmax.argmax(x, 2) is None
    assert cpu_argmax.argmax(x[:2]) is not None  # the other rows alone are decided


def test_nothing_finite_is_undecided_but_minus_inf_entries_are_not() -> None:
    x = torch.full((2, 40), -math.inf)
    assert cpu_argmax.argmax(x) is None
    x[0, 5] = x[1, 39] = -3.0
    assert cpu_argmax.argmax(x).tolist() == [5, 39]  # type: ignore[union-attr]


def test_what_it_does_not_take_is_none() -> None:
    assert cpu_argmax.argmax(torch.randn(3, 40).double()) is None
    assert cpu_argmax.argmax(torch.randn(3, 40).bfloat16()) is None
    assert cpu_argmax.argmax(torch.randn(40, 3).t()) is None  # columns not contiguous
    assert cpu_argmax.argmax(torch.randn(40)) is None
    assert cpu_argmax.argmax(torch.randn(0, 40)) is None
    assert cpu_argmax.argmax(torch.randn(3, 0)) is None
