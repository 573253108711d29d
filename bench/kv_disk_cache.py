"""Time to first token of one long prompt cold, after its blocks left the KV pool, and after an engine restart, with
the KV disk store (`--kv-disk-cache-size`, docs/subsystems/kv-disk-cache.md) bringing its prefix back.

    python -m bench.kv_disk_cache [--model PATH] [--tokens 1800]

In-process EngineCore, greedy, 8 tokens per request; each engine first runs a short unrelated prompt twice (set-up
of the kernels is not prefill). "in the pool": the same prompt again at once. "evicted": another prompt of the same
length then took every block of a pool that holds one prompt. "restart": a new EngineCore on the same store folder;
"restart, page cache dropped" also has the kernel drop the store's files from the page cache first (posix_fadvise
DONTNEED), so the read is from the disk itself. "= pool hit": the tokens equal those of the hit in the pool (the KV
read back is the same bytes; random weights give near-flat logits, so a prefill split otherwise than the cold one's
can flip a greedy pick).
Default model: a random-weight Qwen2.5-0.5B-shape checkpoint (`spindle make-demo --shape qwen2.5-0.5b`).
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from pathlib import Path

from demo.shapes import write_shaped_checkpoint
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.messages import AddRequest, SamplingParams

BLOCK = 16
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def ttft(core: EngineCore, rid: str, prompt: list[int]) -> tuple[float, list[int], int]:
    """(seconds to the first token, the tokens, num_cached_tokens) of one request alone."""
    t0 = time.perf_counter()
    core.add_request(AddRequest(rid, prompt, PARAMS, arrival_time=time.time()))
    first, toks, cached = 0.0, [], -1
    while core.has_work:
        for o in core.step():
            if o.new_token_ids and not first:
                first = time.perf_counter() - t0
            toks += o.new_token_ids
            cached = o.num_cached_tokens if cached < 0 else cached
    return first, toks, cached


def engine(model: str, folder: Path, tokens: int) -> EngineCore:
    blocks = -(-(tokens + PARAMS.max_tokens) // BLOCK) + 8  # one prompt at a time: the next evicts it
    cfg = EngineConfig(
        model=model, block_size=BLOCK, num_blocks=blocks, kv_disk_cache_size=4 << 30, kv_disk_cache_dir=str(folder)
    )
    core = EngineCore(cfg)
    for i in range(2):  # set-up of both shapes (whole prompt; short chunk over cached blocks) is not prefill
        ttft(core, f"warm{i}", [5 + i for i in range(64)])
    return core


def drop_page_cache(folder: Path) -> None:
    for p in folder.iterdir():
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def flush(core: EngineCore) -> None:
    assert core.block_manager.disk is not None
    core.block_manager.disk.store.flush()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=1800)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="spindle-bench-kvdisk-"))
    model = a.model or str(write_shaped_checkpoint(tmp / "model", "qwen2.5-0.5b"))
    rng = random.Random(0)
    prompt, other = ([rng.randrange(100, 150_000) for _ in range(a.tokens)] for _ in range(2))
    core = engine(model, tmp / "kv", a.tokens)
    rows = [("cold", *ttft(core, "cold", prompt)), ("in the pool (prefix cache)", *ttft(core, "pool", prompt))]
    ttft(core, "other", other)  # its blocks push the prompt's out of the pool
    flush(core)
    rows.append(("evicted from the pool", *ttft(core, "evicted", prompt)))
    flush(core)
    del core
    rows.append(("restart", *ttft(engine(model, tmp / "kv", a.tokens), "restart", prompt)))
    drop_page_cache(tmp / "kv")
    rows.append(("restart, page cache dropped", *ttft(engine(model, tmp / "kv", a.tokens), "dropped", prompt)))
    cold_s, cold_tokens, hit_tokens = rows[0][1], rows[0][2], rows[1][2]
    print(f"{'case':<28} {'TTFT s':>7} {'x cold':>7} {'cached':>7} {'= cold':>7} {'= pool hit':>10}")
    for name, s, toks, cached in rows:
        print(
            f"{name:<28} {s:>7.3f} {s / cold_s:>7.2f} {cached:>7} {toks == cold_tokens!s:>7} {toks == hit_tokens!s:>10}"
        )


if __name__ == "__main__":
    main()
