"""A zeroed CPU tensor on fresh anonymous pages: the kernel zeroes each page at its first touch.

torch.zeros writes every byte at once: for the default 1 GiB KV cache that is 0.5 s of CPU at each start, and all
of it resident before a request arrives. Here a page costs only when a block on it is first used. Where the engine
runs with glibc's huge-page tunable (engine/hugepages.py) the pages are asked for as 2 MiB ones, as glibc asks for
the blocks it maps.
"""

from __future__ import annotations

import math
import mmap
import os

import torch

from engine.hugepages import TUNABLE


def _huge_pages_on() -> bool:
    return f"{TUNABLE}=1" in os.environ.get("GLIBC_TUNABLES", "").split(":")


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros of `shape` and `dtype` on the CPU, contiguous; the tensor holds its pages (unmapped with it)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if _huge_pages_on() and hasattr(mmap, "MADV_HUGEPAGE"):
        pages.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(pages, dtype=dtype).view(shape)
