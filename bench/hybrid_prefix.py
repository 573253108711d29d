"""Prefix-cache hit rate on a hybrid model (state snapshots at block-aligned points): requests sharing a prefix of
100, 500 or 2,000 tokens, each with its own 24-token tail, one after another.

    python -m bench.hybrid_prefix [--family lfm2] [--intervals 64 256] [--requests 8]

The hit rate is the prefix cache's hits over its queries, in tokens, over every request but the first (which
finds nothing); "ideal" is what an attention-only model would hit (the shared prefix in whole blocks). Tiny random
checkpoint (tests/engine/models/hybrid_families.py): hits depend on the token layout, not on the weights.
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.messages import AddRequest, SamplingParams
from tests.engine.models.hybrid_families import build_hybrid

BLOCK = 16
TAIL = 24


def hit_rate(ckpt: Path, shared: int, interval: int, requests: int) -> tuple[float, float]:
    """(measured, ideal) hit rates over requests 2..n."""
    core = EngineCore(
        EngineConfig(model=str(ckpt), block_size=BLOCK, num_blocks=2048, state_snapshot_interval=interval)
    )
    rng = random.Random(shared)
    prefix = [rng.randrange(3, 30_000) for _ in range(shared)]
    queries = hits = 0
    for i in range(requests):
        prompt = prefix + [rng.randrange(3, 30_000) for _ in range(TAIL)]
        before = core.stats()
        core.add_request(AddRequest(f"r{i}", prompt, SamplingParams(max_tokens=1, ignore_eos=True), arrival_time=0.0))
        while core.has_work:
            core.step()
        after = core.stats()
        if i:
            queries += after.prefix_cache_queries - before.prefix_cache_queries
            hits += after.prefix_cache_hits - before.prefix_cache_hits
    ideal = (requests - 1) * (shared // BLOCK * BLOCK)
    return hits / queries, ideal / queries


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--family", default="lfm2")
    ap.add_argument("--intervals", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--requests", type=int, default=8)
    a = ap.parse_args()
    ckpt = build_hybrid(Path(tempfile.gettempdir()) / "spindle-bench-hybrids", a.family, max_position_embeddings=4096)
    print(f"{'prefix':>7} {'interval':>8} {'hit rate':>9} {'ideal':>7}")
    for shared in (100, 500, 2000):
        for interval in a.intervals:
            got, ideal = hit_rate(ckpt, shared, interval, a.requests)
            print(f"{shared:>7} {interval:>8} {got:>9.1%} {ideal:>7.1%}")


if __name__ == "__main__":
    main()
