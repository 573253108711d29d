"""The CPU attention path (decode tiles, chunked prefill) against the float32 reference, windows and softcap
included."""

from __future__ import annotations

import random

import pytest
import torch

from engine.core.block_manager import PASSED
from engine.layers import cpu_attention
from engine.layers.cpu_attention import DecodeSeqs, PrefillChunk, decode_attention, prefill_attention
from engine.layers.ops import AttnMetadata, paged_attention
from engine.triton_kernels.paged_common import attend_ref

BS = 4
# Context lengths at the block edges (1, block_size, block_size + 1) and longer ones, in a jumbled order.
MIXED = [BS + 1, 1, 37, BS, 70, 2 * BS, 9]
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}


@pytest.fixture(autouse=True, params=["kernel", "torch"])
def _one_thread(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test on one thread, with bf16 decode both through engine/cpu_kernels (where it runs) and in torch."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if request.param == "torch":
        monkeypatch.setattr(cpu_attention.decode_kernel, "usable", lambda *args: False)


class Cache:
    """Random K/V in a paged cache, each sequence on shuffled blocks; head-major storage like the runner's."""

    def __init__(self, lens: list[int], kv_heads: int, d: int, dtype: torch.dtype, head_major: bool = True) -> None:
        need = [-(-n // BS) for n in lens]
        blocks = list(range(sum(need) + 2))
        random.Random(1).shuffle(blocks)
        self.tables = [[blocks.pop() for _ in range(n)] for n in need]
        nb = sum(need) + 2
        if head_major:
            self.k = torch.randn(kv_heads, nb, BS, d).to(dtype).permute(1, 2, 0, 3)
            self.v = torch.randn(kv_heads, nb, BS, d).to(dtype).permute(1, 2, 0, 3)
        else:
            self.k = torch.randn(nb, BS, kv_heads, d).to(dtype)
            self.v = torch.randn(nb, BS, kv_heads, d).to(dtype)

    def context(self, i: int, first: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [end - first, kv_heads, D] of sequence i's positions [first, end)."""
        slots = [self.tables[i][p // BS] * BS + p % BS for p in range(first, end)]
        return self.k.flatten(0, 1)[slots], self.v.flatten(0, 1)[slots]


def decode_ref(
    q: torch.Tensor, cache: Cache, lens: list[int], window: int | None, softcap: float | None
) -> torch.Tensor:
    out = torch.empty(q.shape)
    for i, n in enumerate(lens):
        first = 0 if window is None else max(0, n - window)
        k, v = cache.context(i, first, n)
        out[i] = attend_ref(q[i : i + 1], k, v, torch.tensor([n - 1]), 0.3, window, softcap, first)[0]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(14, 2, 64), (4, 4, 16), (8, 1, 32)])
@pytest.mark.parametrize("head_major", [True, False])
def test_decode_matches_reference_across_mixed_lengths(
    dtype: torch.dtype, heads: int, kv_heads: int, d: int, head_major: bool
) -> None:
    cache = Cache(MIXED, kv_heads, d, dtype, head_major)
    q = torch.randn(len(MIXED), heads, d).to(dtype)
    seqs = DecodeSeqs(torch.arange(len(MIXED)), MIXED, cache.tables, BS)
    out = decode_attention(q, cache.k, cache.v, seqs, 0.3)
    assert out.dtype == dtype
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float(), decode_ref(q, cache, MIXED, None, None), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (5, None), (None, 2.0), (6, 2.0), (BS, None)])
def test_tiles_with_online_softmax_windows_and_softcap(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, window: int | None, softcap: float | None
) -> None:
    cache = Cache(MIXED, 2, 16, dtype)
    q = (torch.randn(len(MIXED), 4, 16) * 3).to(dtype)  # large scores, so the softcap bites
    seqs = DecodeSeqs(torch.arange(len(MIXED)), MIXED, cache.tables, BS)
    one_tile = decode_attention(q, cache.k, cache.v, seqs, 0.3, window, softcap)
    # tiles of 1 to 8 blocks: row groups, long rows in column tiles (online softmax), rows ending mid-group
    block_bytes = BS * 2 * 16 * q.element_size()
    for blocks in (1, 2, 3, 8):
        monkeypatch.setattr(cpu_attention, "TILE_BYTES", blocks * block_bytes)
        seqs = DecodeSeqs(torch.arange(len(MIXED)), MIXED, cache.tables, BS)
        tiled = decode_attention(q, cache.k, cache.v, seqs, 0.3, window, softcap)
        view = seqs.view(window)
        groups = view.groups(block_bytes)
        assert 1 < len(groups) < len(MIXED) or blocks == 1
        assert any(len(tiles) > 1 for tiles in groups) or view.counts[0] <= blocks
        atol, rtol = TOL[dtype]
        ref = decode_ref(q, cache, MIXED, window, softcap)
        torch.testing.assert_close(tiled.float(), ref, atol=atol, rtol=rtol)
        torch.testing.assert_close(one_tile.float(), ref, atol=atol, rtol=rtol)
    if window is not None or softcap is not None:  # the option changed something
        plain = decode_ref(q, cache, MIXED, None, None)
        assert not torch.allclose(plain, decode_ref(q, cache, MIXED, window, softcap), atol=1e-3)


def test_window_never_reads_passed_blocks() -> None:
    """Blocks before the window may have been released (PASSED entries): they must not be read."""
    lens, window = [30, 7, 21], 6
    cache = Cache(lens, 2, 16, torch.float32)
    q = torch.randn(3, 4, 16)
    ref = decode_ref(q, cache, lens, window, None)

    def passed(table: list[int], computed: int) -> list[int]:  # the block manager's rule, tokens computed so far
        return [PASSED if i < max(0, computed - window + 1) // BS else b for i, b in enumerate(table)]

    tables = [passed(t, n - 1) for t, n in zip(cache.tables, lens)]
    assert PASSED in tables[0]
    seqs = DecodeSeqs(torch.arange(3), lens, tables, BS)
    torch.testing.assert_close(decode_attention(q, cache.k, cache.v, seqs, 0.3, window), ref, atol=1e-5, rtol=1e-5)
    qp = torch.randn(5, 4, 16)
    chunk = PrefillChunk(0, 5, 25, torch.tensor(passed(cache.tables[0], 25)))  # positions 25..29 see 20..29
    torch.testing.assert_close(
        prefill_attention(qp, cache.k, cache.v, chunk, 0.3, window),
        prefill_ref(qp, cache, 0, 25, window, None),
        atol=1e-5,
        rtol=1e-5,
    )


def prefill_ref(
    q: torch.Tensor, cache: Cache, i: int, start: int, window: int | None, softcap: float | None
) -> torch.Tensor:
    k, v = cache.context(i, 0, start + q.shape[0])
    return attend_ref(q, k, v, torch.arange(start, start + q.shape[0]), 0.3, window, softcap)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (3, None), (7, None), (None, 1.5), (5, 1.5)])
@pytest.mark.parametrize("mask_elems", [1 << 21, 40])  # 40: sub-chunks of a few rows each
def test_prefill_chunks_match_reference(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, window: int | None, softcap: float | None, mask_elems: int
) -> None:
    monkeypatch.setattr(cpu_attention, "MASK_ELEMS", mask_elems)
    cache = Cache([37], 2, 16, dtype)
    atol, rtol = TOL[dtype]
    # a fresh prompt, chunks after a cached prefix (mid-block and at a block edge), a chunk smaller than the window
    for start, n in [(0, 37), (0, 9), (13, 24), (BS * 3, 2), (30, 7)]:
        q = (torch.randn(n, 4, 16) * 2).to(dtype)
        chunk = PrefillChunk(0, n, start, torch.tensor(cache.tables[0][: -(-(start + n) // BS)]))
        out = prefill_attention(q, cache.k, cache.v, chunk, 0.3, window, softcap)
        torch.testing.assert_close(out.float(), prefill_ref(q, cache, 0, start, window, softcap), atol=atol, rtol=rtol)


@pytest.mark.parametrize("window", [None, 5])
def test_mixed_step_scatters_decodes_and_prefills(window: int | None) -> None:
    """One flat batch: a prefill chunk between decode rows, as the runner lays it out."""
    lens = [12, 1, 20]
    cache = Cache(lens, 2, 16, torch.float32)
    q = torch.randn(1 + 6 + 1 + 1, 4, 16)  # rows: decode 0, chunk of seq 2 (positions 14..19), decodes 1 and 0'
    decodes = DecodeSeqs(torch.tensor([0, 7]), [12, 1], cache.tables[:2], BS)
    chunk = PrefillChunk(1, 6, 14, torch.tensor(cache.tables[2]))
    meta = AttnMetadata(torch.zeros(0, dtype=torch.long), decodes, [chunk])
    out = paged_attention(q[:8], cache.k, cache.v, meta, 0.3, window=window)
    dec = decode_ref(q[[0, 7]], cache, [12, 1], window, None)
    torch.testing.assert_close(out[[0, 7]], dec, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1:7], prefill_ref(q[1:7], cache, 2, 14, window, None), atol=1e-5, rtol=1e-5)
