"""engine/execution/lazy_zeros.py: zeros on fresh pages, read and written as torch.zeros', resident once used."""

from __future__ import annotations

import gc
import resource

import pytest
import torch

from engine.execution.lazy_zeros import lazy_zeros


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_equal_to_torch_zeros_and_writable(dtype: torch.dtype) -> None:
    x = lazy_zeros((3, 2, 5, 7), dtype)
    assert x.dtype == dtype and x.shape == (3, 2, 5, 7) and x.is_contiguous()
    assert torch.equal(x, torch.zeros(3, 2, 5, 7, dtype=dtype))
    x[1, 0, 2] = 1.5
    assert float(x.sum()) == 1.5 * 7


def test_empty_shape() -> None:
    assert lazy_zeros((0, 4), torch.float32).shape == (0, 4)


def test_pages_are_taken_as_they_are_touched() -> None:
    """512 MiB asked for, one page written: the process's peak RSS grows by far less than the tensor."""
    gc.collect()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    x = lazy_zeros((256, 1 << 20), torch.bfloat16)
    x[0, 0] = 1.0
    assert float(x[-1, -1]) == 0.0
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 << 10
