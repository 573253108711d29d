"""Paged KV block manager with automatic prefix caching.

The KV cache is `num_blocks` blocks of `block_size` token slots; a sequence holds the blocks
listed in `seq.block_table`. A block that is FULL of computed tokens is registered in the
prefix cache under the key (parent content id, its token ids): content ids are handed out
per registration, so a key names its whole prefix exactly (no hash collision can ever serve
wrong KV: the dict compares the token tuple itself). Freed registered blocks stay "free but
cached" and are evicted least-recently-freed first when the pool needs blocks.

With a sliding window on every layer (`window`: the largest), a block whose last position every later
query's window has passed is released while the sequence runs: its table entry becomes PASSED (the
entry stays, so position p still maps to entry p // block_size), and the block goes back to the pool,
still cached if registered. Prefix hits that the first new query's window has passed are not taken at
all. Attention never reads a PASSED entry: it starts each query's keys at its window.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Any

from engine.core.kv_offload import KVOffload
from engine.core.state_pool import StatePool
from engine.types.sequence import Sequence

# (parent content id, the block's token ids[, the images in it: (hash, offset in the image) each])
_CacheKey = tuple[Any, ...]
_ROOT = -1  # the parent content id of a sequence's first block
PASSED = -1  # a block-table entry whose block every later query's window has passed (released)


def _block_key(seq: Sequence, parent: int, i: int, bs: int) -> _CacheKey:
    """Block i's cache key: image placeholder tokens are all alike, so blocks holding images add their hashes. A
    request's adapter roots its chain in the adapter's content digest: no KV is shared across adapters."""
    root: int | str = seq.lora.digest if i == 0 and seq.lora is not None else parent  # a str: never a content id
    key = (root, tuple(seq.token_ids[i * bs : (i + 1) * bs]))
    if seq.mm is not None and (extra := seq.mm.block_extra(i * bs, (i + 1) * bs)):
        return key + (extra,)
    return key


def block_hash(seq: Sequence, parent: str, i: int, bs: int) -> str:
    """Block i's stable name for the disk store: a hash chained on its parent's, over what `_block_key` holds
    (the adapter's digest at the chain's root, the token ids, the images' hashes), the same in every process."""
    h = hashlib.sha256(parent.encode())
    if i == 0 and seq.lora is not None:
        h.update(b"lora:" + seq.lora.digest.encode())
    h.update(array("q", seq.token_ids[i * bs : (i + 1) * bs]).tobytes())
    if seq.mm is not None and (extra := seq.mm.block_extra(i * bs, (i + 1) * bs)):
        h.update(repr(extra).encode())
    return h.hexdigest()


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        window: int | None = None,
        state: StatePool | None = None,
        disk: KVOffload | None = None,
        disk_blocks_per_step: int = 256,
    ) -> None:
        """state: a hybrid model's recurrent-state slots, taken with a sequence's first blocks, freed with them.
        disk: full blocks leaving the pool go there and come back on a later lookup (never for a hybrid model:
        its state snapshots are not on disk), at most disk_blocks_per_step read back per step."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be at least 1")
        if window is not None and window < 1:
            raise ValueError(f"window must be at least 1, not {window}")
        self.num_total_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.window = window  # every layer's window is at most this; None: some layer reads everything
        if state is not None and enable_prefix_caching and not state.interval:
            raise ValueError("prefix caching without state snapshots would restore KV without its recurrent state")
        self.state = state
        self.disk = disk if enable_prefix_caching and state is None else None
        self.disk_blocks_per_step = disk_blocks_per_step
        self._disk_budget = disk_blocks_per_step
        self.disk_pending = False  # the last lookup stopped at the step's read budget with more on disk
        self._hash: list[str] = [""] * num_blocks  # a registered block's disk name (with a disk store)
        self._chain_hash: dict[Sequence, str] = {}  # per held sequence: the hash of its last registered block
        self._ref = [0] * num_blocks  # how many sequences hold each block
        self._key: list[_CacheKey | None] = [None] * num_blocks  # registered under this key
        self._cid = [_ROOT] * num_blocks  # content id while registered
        self._cache: dict[_CacheKey, int] = {}  # key -> block id
        self._next_cid = 0
        # free blocks: never-cached ones first (a stack), then cached ones in LRU order
        self._free_plain: list[int] = list(range(num_blocks - 1, -1, -1))
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        # per held sequence: [blocks registered (or matched), content id of the last of them]
        self._chain: dict[Sequence, list[int]] = {}
        self._passed: dict[Sequence, int] = {}  # leading table entries released (PASSED), per sequence
        self.prefix_cache_queries = 0  # cumulative, in tokens
        self.prefix_cache_hits = 0  # cumulative, in tokens

    # ---- counts -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_total_blocks - self.num_free_blocks

    @property
    def usage(self) -> tuple[int, int]:
        """(used, total) for the KV-usage metric: blocks, plus the state pool weighed in blocks (slots held, all)."""
        if self.state is None:
            return self.num_used_blocks, self.num_total_blocks
        w = self.state.slot_blocks
        return self.num_used_blocks + w * self.state.num_used, self.num_total_blocks + w * self.state.num_slots

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cache)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def most_blocks_held(self, num_tokens: int, chunk: int) -> int:
        """The most blocks a sequence of num_tokens holds at once, computed chunk tokens at a time at most."""
        full = self.blocks_needed(num_tokens)
        if self.window is None:
            return full
        # blocks from the one holding computed - window + 1 to the one holding computed + chunk - 1
        return min(full, self.blocks_needed(self.window - 1 + chunk) + 1)

    def passed_blocks(self, num_computed: int) -> int:
        """Leading blocks no query at position >= num_computed reads: every layer's window has passed them."""
        if self.window is None:
            return 0
        return max(0, num_computed - self.window + 1) // self.block_size

    # ---- prefix lookup + allocation ---------------------------------------------------------
    def begin_step(self) -> None:
        """A new step: its budget of blocks read back from the disk store."""
        self._disk_budget = self.disk_blocks_per_step

    def lookup(self, seq: Sequence) -> list[int]:
        """Cached blocks matching the start of seq.token_ids.

        At most (num_tokens - 1) // block_size blocks: the last token is always computed, so
        the step that schedules it yields logits. With a disk store, the blocks past the pool's hits
        are read back into free blocks and registered (free but cached) as if computed, within the
        step's budget; `disk_pending` then says whether the chain goes on past it.
        """
        self.disk_pending = False
        if not self.enable_prefix_caching:
            return []
        bs, ids = self.block_size, seq.token_ids
        hits: list[int] = []
        parent = _ROOT
        limit = (len(ids) - 1) // bs
        for i in range(limit):
            block = self._cache.get(_block_key(seq, parent, i, bs))
            if block is None:
                break
            hits.append(block)
            parent = self._cid[block]
        if self.disk is not None and len(hits) < limit:
            self._read_back(seq, hits, limit)
        if self.state is not None:  # a hybrid model: only as far as a snapshot of the state at that point
            return hits[: self.state.usable_hits(seq, len(hits), self._cid, hits, bs)]
        return hits

    def _read_back(self, seq: Sequence, hits: list[int], limit: int) -> None:
        """Extend hits with the blocks the disk store holds next in seq's chain, read into free blocks."""
        assert self.disk is not None
        bs = self.block_size
        for b in hits:  # the pool's hits are never evicted to make room for the rest
            if b in self._free_cached:
                self._free_cached.move_to_end(b)
        spare = self.num_free_blocks - sum(1 for b in hits if self._ref[b] == 0)
        parent = self._cid[hits[-1]] if hits else _ROOT
        h = self._hash[hits[-1]] if hits else ""
        for i in range(len(hits), limit):
            h = block_hash(seq, h, i, bs)
            if not self.disk.has(h):
                return
            if self._disk_budget <= 0 or spare <= 0:
                self.disk_pending = self._disk_budget <= 0  # the next step reads on; a full pool: compute
                return
            b = self._pop_free()
            if not self.disk.load(b, h):  # damaged on disk (deleted there): compute from here
                self._ref[b] = 0
                self._free_plain.append(b)
                return
            self._disk_budget -= 1
            spare -= 1
            parent = self._register(b, _block_key(seq, parent, i, bs), h)
            self._unref(b)  # free but cached, most recently used
            hits.append(b)

    def allocate(self, seq: Sequence, num_new_tokens: int, hits: list[int] | None = None) -> bool:
        """Make room for seq's next `num_new_tokens` tokens; False (and no change) if blocks run out.

        `hits` (from lookup, only when seq holds no blocks) are shared, and the new tokens then
        start after them: the caller sets seq.num_computed_tokens = len(hits) * block_size.
        """
        table = seq.block_table
        skip = 0
        if hits:
            assert not table, "prefix hits are only taken by a sequence that holds no blocks"
            computed = len(hits) * self.block_size
            skip = self.passed_blocks(computed)  # hits no new query reads stay in the pool
            # a hit that is free-but-cached leaves the free pool when it is taken
            reused = sum(1 for b in hits[skip:] if self._ref[b] == 0)
        else:
            computed, reused = seq.num_computed_tokens, 0
        need = self.blocks_needed(computed + num_new_tokens) - len(table) - (len(hits) if hits else 0)
        if need > self.num_free_blocks - reused:
            return False
        if not table and self.state is not None and not self.state.take(seq):
            return False  # no recurrent-state slot free: waits as for blocks
        if not table:
            self.prefix_cache_queries += seq.num_tokens if self.enable_prefix_caching else 0
            self._chain[seq] = [0, _ROOT]
            self._chain_hash[seq] = self._hash[hits[-1]] if hits else ""
        if hits:
            for b in hits[skip:]:
                if self._ref[b] == 0:
                    del self._free_cached[b]
                self._ref[b] += 1
            table.extend([PASSED] * skip + hits[skip:])
            self._passed[seq] = skip
            self._chain[seq] = [len(hits), self._cid[hits[-1]]]
            self.prefix_cache_hits += computed
            if self.state is not None:
                self.state.restore_from(seq, self._cid[hits[-1]])
        for _ in range(need):
            table.append(self._pop_free())
        return True

    def _pop_free(self) -> int:
        if self._free_plain:
            b = self._free_plain.pop()
        else:
            b, _ = self._free_cached.popitem(last=False)  # evict the least recently freed
            key = self._key[b]
            if key is not None:
                if self.state is not None:
                    self.state.drop(self._cid[b])  # the snapshot at this block's end goes with its KV
                del self._cache[key]
                self._key[b] = None
                self._hash[b] = ""
                self._cid[b] = _ROOT
        self._ref[b] = 1
        return b

    # ---- registration + freeing ------------------------------------------------------------
    def register_full_blocks(self, seq: Sequence, upto: int | None = None) -> None:
        """Enter seq's blocks that are full of computed tokens into the prefix cache.

        `upto`: count tokens [0, upto) as computed (default: seq.num_computed_tokens). The scheduler
        passes the end of the chunk it just admitted, so a request admitted later in the SAME step
        (an n > 1 sibling) shares those blocks: every layer writes the whole batch's K/V before
        attention reads it, and nothing scheduled from the waiting queue is preempted in that step.
        """
        chain = self._chain.get(seq)
        if chain is None or not self.enable_prefix_caching:
            return
        bs, table = self.block_size, seq.block_table
        done, parent = chain
        computed = seq.num_computed_tokens if upto is None else upto
        full = min(computed // bs, len(table))
        h = self._chain_hash.get(seq, "")
        for i in range(done, full):
            key = _block_key(seq, parent, i, bs)
            h = block_hash(seq, h, i, bs) if self.disk is not None else ""
            existing = self._cache.get(key)
            if existing is None:  # new content: register this block
                parent = self._register(table[i], key, h)
            else:  # another sequence computed the same block: chain on through its content id
                parent = self._cid[existing]
            if self.state is not None:
                self.state.bind(seq, (i + 1) * bs, parent)  # a snapshot of the state at this block's end
        chain[0], chain[1] = max(done, full), parent
        self._chain_hash[seq] = h

    def _register(self, b: int, key: _CacheKey, h: str) -> int:
        """Enter block b into the prefix cache under key (and h, its disk name); its new content id."""
        self._cache[key] = b
        self._key[b] = key
        self._hash[b] = h
        self._cid[b] = cid = self._next_cid
        self._next_cid += 1
        return cid

    def release_passed(self, seq: Sequence) -> None:
        """Release the blocks every layer's window has passed, after a step computed seq's tokens
        (call after register_full_blocks: a passed block is full, so it is registered first)."""
        table = seq.block_table
        done = self._passed.get(seq, 0)
        upto = min(self.passed_blocks(seq.num_computed_tokens), len(table))
        for i in range(done, upto):
            self._unref(table[i])
            table[i] = PASSED
        if upto > done:
            self._passed[seq] = upto

    def trim(self, seq: Sequence) -> None:
        """Release the table's blocks past those seq's tokens need (a verification's rejected draft positions
        wrote there); they were never registered: only computed (accepted) tokens' blocks are."""
        table = seq.block_table
        keep = self.blocks_needed(seq.num_tokens)
        while len(table) > keep:
            self._unref(table.pop())

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks; registered ones stay cached, the tail's evicted before the head."""
        self._chain.pop(seq, None)
        self._chain_hash.pop(seq, None)
        self._passed.pop(seq, None)
        if self.state is not None:
            self.state.release(seq)  # a preempted sequence recomputes its state with its KV
        for b in reversed(seq.block_table):
            if b != PASSED:
                self._unref(b)
        seq.block_table = []

    def _unref(self, b: int) -> None:
        self._ref[b] -= 1
        if self._ref[b] == 0:
            if self._key[b] is not None:
                self._free_cached[b] = None
                if self.disk is not None:  # leaving the pool's hold: kept on disk past eviction and restarts
                    self.disk.save(b, self._hash[b])
            else:
                self._free_plain.append(b)
