"""engine/cpu_kernels/decode_attention.py against softmax attention written out in float64: GQA shapes, head
dims up to 256, windows, softcap, both cache layouts, released blocks before a window, long contexts."""

from __future__ import annotations

import random

import pytest
import torch

from engine.core.block_manager import PASSED
from engine.cpu_kernels import decode_attention as kernel
from engine.layers.cpu_attention import DecodeSeqs, decode_attention

pytestmark = pytest.mark.skipif(
    not kernel.usable(torch.zeros(1, 2, 32, dtype=torch.bfloat16), torch.zeros(1, 4, 2, 32, dtype=torch.bfloat16)),
    reason="no AVX512-BF16 CPU kernel here (CPU or compiler)",
)
BS = 4
LENS = [BS + 1, 1, 37, BS, 70, 2 * BS, 9]  # block edges and longer contexts, jumbled


def paged(
    lens: list[int], kv_heads: int, d: int, head_major: bool, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // BS) for n in lens]
    blocks = list(range(sum(need) + 2))
    random.Random(seed).shuffle(blocks)
    tables = [[blocks.pop() for _ in range(n)] for n in need]
    nb = sum(need) + 2
    if head_major:  # the runner's CPU storage: [kv_heads, blocks, block_size, D] seen as [blocks, bs, kv_heads, D]
        return (
            torch.randn(kv_heads, nb, BS, d, generator=g).bfloat16().permute(1, 2, 0, 3),
            torch.randn(kv_heads, nb, BS, d, generator=g).bfloat16().permute(1, 2, 0, 3),
            tables,
        )
    return (
        torch.randn(nb, BS, kv_heads, d, generator=g).bfloat16(),
        torch.randn(nb, BS, kv_heads, d, generator=g).bfloat16(),
        tables,
    )


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tables: list[list[int]],
    lens: list[int],
    window: int | None,
    softcap: float | None,
    scale: float,
) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=torch.float64)
    heads, kv_heads = q.shape[1], k.shape[2]
    for b, n in enumerate(lens):
        lo = 0 if window is None else max(0, n - window)
        slots = [tables[b][p // BS] * BS + p % BS for p in range(lo, n)]
        kk, vv = k.flatten(0, 1)[slots].double(), v.flatten(0, 1)[slots].double()
        for h in range(heads):
            s = kk[:, h // (heads // kv_heads)] @ q[b, h].double() * scale
            if softcap is not None:
                s = softcap * torch.tanh(s / softcap)
            out[b, h] = torch.softmax(s, dim=0) @ vv[:, h // (heads // kv_heads)]
    return out


def assert_rounded_once(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32 arithmetic, then one rounding to bf16: within half a bf16 step (and float32's own error)."""
    half_ulp = want.abs() * torch.finfo(torch.bfloat16).eps / 2
    err = (got.double() - want).abs()
    assert bool((err <= half_ulp * 1.01 + 1e-5).all()), float((err - half_ulp).max())


@pytest.mark.parametrize(
    ("heads", "kv_heads", "d"),
    [(14, 2, 64), (4, 4, 32), (8, 1, 128), (4, 2, 256), (24, 1, 96), (12, 1, 64), (6, 2, 160), (10, 2, 224)],
)  # groups 1-24
@pytest.mark.parametrize("head_major", [True, False])
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (5, None), (BS, None), (None, 2.0), (6, 2.0)])
def test_matches_float64_softmax_attention(
    heads: int, kv_heads: int, d: int, head_major: bool, window: int | None, softcap: float | None
) -> None:
    k, v, tables = paged(LENS, kv_heads, d, head_major)
    q = (torch.randn(len(LENS), heads, d, generator=torch.Generator().manual_seed(1)) * 2).bfloat16()
    seqs = DecodeSeqs(torch.arange(len(LENS)), LENS, tables, BS)
    got = kernel.attend(q, k, v, *seqs.kernel_args(window), 0.3, softcap)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    assert_rounded_once(got, reference(q, k, v, tables, LENS, window, softcap, 0.3))
    assert torch.equal(decode_attention(q, k, v, seqs, 0.3, window, softcap), got)  # the CPU path takes it


def test_threads_and_batch_neighbours_change_no_bit() -> None:
    k, v, tables = paged(LENS, 2, 64, True)
    q = torch.randn(len(LENS), 14, 64).bfloat16()
    args = DecodeSeqs(torch.arange(len(LENS)), LENS, tables, BS).kernel_args(None)
    two = kernel.attend(q, k, v, *args, 0.125, threads=2)
    assert torch.equal(kernel.attend(q, k, v, *args, 0.125, threads=1), two)
    alone = DecodeSeqs(torch.arange(1), LENS[4:5], tables[4:5], BS).kernel_args(None)
    assert torch.equal(kernel.attend(q[4:5], k, v, *alone, 0.125)[0], two[4])


def test_window_never_reads_released_blocks() -> None:
    """Blocks wholly before the window may be released (PASSED): the kernel must not read them."""
    lens, window = [30, 7, 21], 6
    k, v, tables = paged(lens, 2, 32, True)
    q = torch.randn(3, 4, 32).bfloat16()  # (d 32: one pair of k per dot product)
    want = reference(q, k, v, tables, lens, window, None, 0.3)
    released = [
        [PASSED if i < max(0, n - window) // BS else blk for i, blk in enumerate(t)] for t, n in zip(tables, lens)
    ]
    assert PASSED in released[0]
    got = kernel.attend(q, k, v, *DecodeSeqs(torch.arange(3), lens, released, BS).kernel_args(window), 0.3)
    assert_rounded_once(got, want)


def test_a_long_context_and_peaked_scores() -> None:
    lens = [3001, 2]
    k, v, tables = paged(lens, 1, 128, True, seed=3)
    q = (torch.randn(2, 2, 128) * 8).bfloat16()  # large scores: the softmax's max must be taken first
    got = kernel.attend(q, k, v, *DecodeSeqs(torch.arange(2), lens, tables, BS).kernel_args(None), 0.0884)
    assert_rounded_once(got, reference(q, k, v, tables, lens, None, None, 0.0884))


def test_shapes_it_cannot_take_keep_the_torch_path() -> None:
    cache = torch.zeros(2, BS, 2, 32, dtype=torch.bfloat16)
    assert kernel.usable(torch.zeros(1, 4, 32, dtype=torch.bfloat16), cache)
    assert not kernel.usable(
        torch.zeros(1, 4, 48, dtype=torch.bfloat16), torch.zeros(2, BS, 2, 48, dtype=torch.bfloat16)
    )
    assert not kernel.usable(
        torch.zeros(1, 4, 288, dtype=torch.bfloat16), torch.zeros(2, BS, 2, 288, dtype=torch.bfloat16)
    )
    assert not kernel.usable(torch.zeros(1, 4, 32), cache.float())  # float32
    assert not kernel.usable(torch.zeros(1, 3, 32, dtype=torch.bfloat16), cache)  # heads not a multiple of kv heads
    with pytest.raises(ValueError, match="softcap"):
        kernel.attend(
            torch.zeros(1, 4, 32, dtype=torch.bfloat16),
            cache,
            cache,
            torch.zeros(1, 1, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32),
            torch.zeros(1, dtype=torch.int32),
            1.0,
            softcap=float("nan"),
        )
