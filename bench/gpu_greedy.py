"""Greedy decoding on the GPU path (CUDA, Triton kernels) against the CPU path, both in float32.

    python -m bench.gpu_greedy --model DIR [--prompts 8] [--tokens 32] [--device cuda]

Exits 1 when a continuation differs and prints where (a near tie between the top two logits can flip
under another summation order without either path being wrong: look at the first differing token).
"""

from __future__ import annotations

import argparse
import random
import sys

from bench.quant_agreement import greedy as run_greedy
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore


def greedy(model: str, device: str, dtype: str, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    core = EngineCore(
        EngineConfig(model=model, dtype=dtype, device=device, max_num_seqs=len(prompts), enable_prefix_caching=False)
    )
    return run_greedy(core, prompts, tokens)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompt-len", type=int, default=24)
    a = ap.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 150_000) for _ in range(a.prompt_len + 5 * i)] for i in range(a.prompts)]
    ref = greedy(a.model, "cpu", "float32", prompts, a.tokens)
    got = greedy(a.model, a.device, "float32", prompts, a.tokens)
    bf16 = greedy(a.model, a.device, "bfloat16", prompts, a.tokens)
    equal = sum(r == g for r, g in zip(ref, got))
    shared = sum(x == y for r, b in zip(ref, bf16) for x, y in zip(r, b))
    print(
        f"greedy, {a.prompts} prompts x {a.tokens} tokens: {a.device} float32 equals cpu float32 on "
        f"{equal}/{a.prompts}; {a.device} bfloat16 shares {shared}"
        f"/{a.prompts * a.tokens} tokens with it"
    )
    for i, (r, g) in enumerate(zip(ref, got)):
        if r != g:
            at = next(j for j, (x, y) in enumerate(zip(r, g)) if x != y)
            print(f"  prompt {i}: first difference at token {at}: cpu {r[at]} vs {a.device} {g[at]}")
    sys.exit(0 if equal == a.prompts else 1)


if __name__ == "__main__":
    main()
