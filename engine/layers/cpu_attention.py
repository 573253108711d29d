"""Paged attention on CPU in plain torch: decode as blocked grouped products, prefill as chunked SDPA.

A layer's cache is read head-major, as [kv_heads, num_blocks, block_size, D] (`k_cache.permute(2, 0, 1, 3)`);
the runner allocates the CPU cache in that order, so gathering a sequence's blocks copies whole runs of
block_size * D values per head and the products read contiguous keys. Any cache layout still gives the
same result (the gather then reads strided rows).

Decode (one query token per sequence) never calls SDPA: on CPU it runs a tiled flash kernel per token
(bench/README.md, "Decode attention on the torch path"). In bfloat16 where engine/cpu_kernels' decode attention runs, it
reads each sequence's blocks in place (no gather, no padding). Otherwise the sequences, sorted by blocks read (longest
first), go in row groups of about TILE_BYTES of keys: per group the query heads of each kv head (a
[group, D] matrix: GQA without repeating K/V) meet the group's gathered keys in one batched product, with
the softmax in float32. Short contexts make one group (one gather, a handful of ops per layer); long ones
are never padded to the batch's longest, and a context longer than a tile is read in column tiles with an
online softmax.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.cpu_kernels import decode_attention as decode_kernel
from engine.layers.parallel import WORKERS
from engine.layers.softcap import soft_cap_

TILE_BYTES = 2 << 20  # one decode tile's gathered K (or V): stays in cache; a fresh big gather page-faults
MASK_ELEMS = 1 << 21  # rows x keys of one prefill sub-chunk: bounds its mask (and softcap's scores per head)

Tile = tuple[int, int, int, int]  # sorted rows [r0, r1), block columns [j0, j1) of a view's tables


@dataclass
class PrefillChunk:
    """A sequence running several tokens: rows [q_start, q_start + q_len) of the flat batch, at positions
    [start, start + q_len); the positions before start are already in the cache."""

    q_start: int
    q_len: int
    start: int
    blocks: torch.Tensor  # long: the sequence's blocks covering positions [0, start + q_len)


@dataclass
class DecodeView:
    """The decode sequences as a layer with one window reads them, sorted by blocks read (longest first)."""

    order: torch.Tensor | None  # long [B]: the DecodeSeqs index of each sorted row; None: already sorted
    tables: torch.Tensor  # long [B, width]: blocks from the first the window reaches, padded with block 0
    bias: torch.Tensor  # float32 [B, width * block_size]: 0 where a gathered key is visible, -inf elsewhere
    counts: list[int]  # blocks read by each sorted row, descending
    plans: dict[int, list[list[Tile]]] = field(default_factory=dict)  # bytes of one block -> groups

    def groups(self, block_bytes: int) -> list[list[Tile]]:
        """Row groups of about TILE_BYTES of keys each (rows padded to the group's first, longest row);
        a row longer than that alone gets column tiles, which its group's softmax runs across online."""
        plan = self.plans.get(block_bytes)
        if plan is None:
            plan, r0, counts = [], 0, self.counts
            while r0 < len(counts):
                width, r1 = counts[r0], r0 + 1
                while r1 < len(counts) and (r1 + 1 - r0) * width * block_bytes <= TILE_BYTES:
                    r1 += 1
                step = max(1, TILE_BYTES // ((r1 - r0) * block_bytes))
                # a tile takes only the group's rows that still have blocks there (counts descend)
                plan.append(
                    [
                        (r0, r0 + sum(1 for c in counts[r0:r1] if c > j0), j0, min(width, j0 + step))
                        for j0 in range(0, width, step)
                    ]
                )
                r0 = r1
            self.plans[block_bytes] = plan
        return plan


class DecodeSeqs:
    """The step's single-token sequences: rows of the flat batch, context lengths, block tables.

    Shared by all layers; each window's view is built on its first use in the step."""

    def __init__(self, rows: torch.Tensor, ctx_lens: list[int], tables: list[list[int]], block_size: int) -> None:
        self.rows, self.ctx_lens, self.tables, self.block_size = rows, ctx_lens, tables, block_size
        self._views: dict[int | None, DecodeView] = {}
        self._kernel_args: dict[int | None, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def __len__(self) -> int:
        return len(self.ctx_lens)

    def view(self, window: int | None) -> DecodeView:
        found = self._views.get(window)
        if found is None:
            found = self._views[window] = self._build(window)
        return found

    def kernel_args(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """int32 block tables [B, widest] from position 0, context lengths, and each query's first visible key."""
        found = self._kernel_args.get(window)
        if found is None:
            width = max(len(t) for t in self.tables)
            tables = torch.tensor([t + [0] * (width - len(t)) for t in self.tables], dtype=torch.int32)
            los = [0 if window is None else max(0, n - window) for n in self.ctx_lens]
            found = self._kernel_args[window] = (
                tables,
                torch.tensor(self.ctx_lens, dtype=torch.int32),
                torch.tensor(los, dtype=torch.int32),
            )
        return found

    def _build(self, window: int | None) -> DecodeView:
        bs, lens = self.block_size, self.ctx_lens
        # the query at position n - 1 sees keys [lo, n): lo = n - window with a window
        los = [0 if window is None else max(0, n - window) for n in lens]
        firsts = [lo // bs for lo in los]
        counts = [(n - 1) // bs + 1 - f for n, f in zip(lens, firsts)]
        order = sorted(range(len(lens)), key=lambda i: -counts[i])
        width = counts[order[0]]
        rows = []
        for i in order:
            row = self.tables[i][firsts[i] : firsts[i] + counts[i]]
            rows.append(row + [0] * (width - len(row)))
        pos = torch.arange(width * bs)[None, :] + torch.tensor([firsts[i] * bs for i in order])[:, None]
        visible = (pos < torch.tensor([lens[i] for i in order])[:, None]) & (
            pos >= torch.tensor([los[i] for i in order])[:, None]
        )
        bias = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
        same = order == sorted(order)  # no reordering: saves a gather of q and a scatter of the output
        dev = self.rows.device  # built on the host, then one copy each to the cache's device
        return DecodeView(
            None if same else torch.tensor(order).to(dev),
            torch.tensor(rows, dtype=torch.long).to(dev),
            bias.to(dev),
            [counts[i] for i in order],
        )


def _head_major(cache: torch.Tensor) -> torch.Tensor:
    return cache.permute(2, 0, 1, 3)  # [num_blocks, block_size, kv_heads, D] -> [kv_heads, num_blocks, ...]


def _gather(cache_hm: torch.Tensor, tables: torch.Tensor, tile: Tile) -> torch.Tensor:
    """[kv_heads, rows, (j1 - j0) * block_size, D]: the tile's blocks of its rows, contiguous per head."""
    r0, r1, j0, j1 = tile
    kv_heads, _, bs, d = cache_hm.shape
    return cache_hm.index_select(1, tables[r0:r1, j0:j1].flatten()).view(kv_heads, r1 - r0, (j1 - j0) * bs, d)


def _scores(
    qh: torch.Tensor, k_hm: torch.Tensor, view: DecodeView, tile: Tile, scale: float, softcap: float | None
) -> torch.Tensor:
    """float32 [kv_heads, rows, group, keys]: scaled (and soft-capped) scores, -inf where not visible."""
    r0, r1, j0, j1 = tile
    bs = k_hm.shape[2]
    k = _gather(k_hm, view.tables, tile)
    s = torch.matmul(qh[:, r0:r1], k.transpose(2, 3)).float().mul_(scale)
    if softcap is not None:
        s = soft_cap_(s, softcap)
    return s.add_(view.bias[r0:r1, j0 * bs : j1 * bs][None, :, None, :])


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seqs: DecodeSeqs,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q [B, heads, D], one token per sequence of `seqs` (in its order) -> [B, heads, D]."""
    if decode_kernel.usable(q, k_cache):
        keys = sum(seqs.ctx_lens) * q.shape[1] * q.shape[2]  # multiply-adds per product (scores, then values)
        threads = WORKERS.threads_for(2 * keys, 2 * keys * k_cache.shape[2] // q.shape[1] * k_cache.element_size())
        return decode_kernel.attend(q, k_cache, v_cache, *seqs.kernel_args(window), scale, softcap, threads)
    b, heads, d = q.shape
    k_hm, v_hm = _head_major(k_cache), _head_major(v_cache)
    kv_heads, _, bs, _ = k_hm.shape
    view = seqs.view(window)
    # [kv_heads, B, group, D]: query head h reads kv head h // group
    q_sorted = q if view.order is None else q.index_select(0, view.order)
    qh = q_sorted.view(b, kv_heads, heads // kv_heads, d).transpose(0, 1)
    out = q.new_empty(kv_heads, b, heads // kv_heads, d)
    for tiles in view.groups(kv_heads * bs * d * k_cache.element_size()):
        r0, r1 = tiles[0][:2]
        if len(tiles) == 1:  # the group's whole context in one tile: a plain softmax
            p = torch.softmax(_scores(qh, k_hm, view, tiles[0], scale, softcap), dim=-1)
            v = _gather(v_hm, view.tables, tiles[0])
            out[:, r0:r1] = torch.matmul(p.to(v.dtype), v)
        else:
            out[:, r0:r1] = _online_softmax(qh, k_hm, v_hm, view, tiles, scale, softcap)
    out_sorted = out.transpose(0, 1).reshape(b, heads, d)
    return out_sorted if view.order is None else torch.empty_like(q).index_copy_(0, view.order, out_sorted)


def _online_softmax(
    qh: torch.Tensor,
    k_hm: torch.Tensor,
    v_hm: torch.Tensor,
    view: DecodeView,
    tiles: list[Tile],
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """Flash-decoding over one group's column tiles in float32: running max, running sum, rescaled sum."""
    kv_heads, _, group, d = qh.shape
    r0, rows = tiles[0][0], tiles[0][1] - tiles[0][0]
    m = torch.full((kv_heads, rows, group, 1), float("-inf"), device=qh.device)
    total = torch.zeros(kv_heads, rows, group, 1, device=qh.device)
    acc = torch.zeros(kv_heads, rows, group, d, device=qh.device)
    for tile in tiles:
        n = tile[1] - r0
        s = _scores(qh, k_hm, view, tile, scale, softcap)
        # every row of a tile sees at least one key there (its first block of the tile), so m_new is finite
        m_new = torch.maximum(m[:, :n], s.amax(dim=-1, keepdim=True))
        alpha = torch.exp(m[:, :n] - m_new)
        p = s.sub_(m_new).exp_()
        total[:, :n].mul_(alpha).add_(p.sum(dim=-1, keepdim=True))
        v = _gather(v_hm, view.tables, tile)
        acc[:, :n].mul_(alpha).add_(torch.matmul(p.to(v.dtype), v))
        m[:, :n] = m_new
    return acc.div_(total)


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    chunk: PrefillChunk,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q [q_len, heads, D] -> [q_len, heads, D] over the chunk's visible context (cached prefix + itself).

    SDPA (torch's flash kernel) per sub-chunk of rows, each with only the keys its rows can see, so one
    sub-chunk's mask stays within MASK_ELEMS however long the prompt."""
    k_hm, v_hm = _head_major(k_cache), _head_major(v_cache)
    bs = k_hm.shape[2]
    start, q_len = chunk.start, chunk.q_len
    lo = 0 if window is None else max(0, start - window + 1)  # the first query's first visible key
    first = lo // bs
    k = k_hm.index_select(1, chunk.blocks[first:]).flatten(1, 2)  # [kv_heads, keys, D] from first * bs
    v = v_hm.index_select(1, chunk.blocks[first:]).flatten(1, 2)
    base = first * bs
    heads = q.shape[1] if softcap is not None else 1  # the softcap path holds float32 scores per head
    rows = max(1, MASK_ELEMS // (heads * (start + q_len - lo)))
    out = torch.empty_like(q)
    for r0 in range(0, q_len, rows):
        r1 = min(q_len, r0 + rows)
        q_lo, q_hi = start + r0, start + r1  # query positions [q_lo, q_hi)
        k_lo = lo if window is None else max(lo, q_lo - window + 1)
        ks, vs = k[:, k_lo - base : q_hi - base], v[:, k_lo - base : q_hi - base]
        qs = q[r0:r1].transpose(0, 1)  # [heads, rows, D]
        out[r0:r1] = _attend(qs, ks, vs, q_lo, k_lo, scale, window, softcap).transpose(0, 1)
    return out


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_lo: int,
    k_lo: int,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """q [heads, rows, D] at positions q_lo.. over k, v [kv_heads, keys, D] at positions k_lo.. -> [heads, rows, D]."""
    rows, keys = q.shape[1], k.shape[1]
    gqa = q.shape[0] != k.shape[0]
    # keys start at the first query and the window spans all rows: the mask is SDPA's own causal one
    if softcap is None and k_lo == q_lo and (window is None or rows <= window):
        return F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=scale, enable_gqa=gqa)[0]
    q_pos = torch.arange(q_lo, q_lo + rows, device=q.device)[:, None]
    k_pos = torch.arange(k_lo, k_lo + keys, device=q.device)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= q_pos - k_pos < window
    if softcap is None:
        return F.scaled_dot_product_attention(
            q[None], k[None], v[None], attn_mask=allowed, scale=scale, enable_gqa=gqa
        )[0]
    # soft-capping has no SDPA form: the math, query heads grouped per kv head
    kv_heads = k.shape[0]
    qg = q.reshape(kv_heads, -1, rows, q.shape[2]).float()  # [kv_heads, group, rows, D]
    s = torch.matmul(qg, k.float()[:, None].transpose(2, 3)).mul_(scale)
    s = soft_cap_(s, softcap).masked_fill_(~allowed, float("-inf"))
    out = torch.matmul(torch.softmax(s, dim=-1), v.float()[:, None])
    return out.reshape(q.shape).to(q.dtype)
