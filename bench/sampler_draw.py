"""One sampler draw per setting, in ms (median of --tries), on random logits of a vocabulary's size: greedy,
llama.cpp's server defaults, Gemma's and Qwen's generation_config, temperature 1, and SmolLM2's model card
(temperature 0.2, top_p 0.9: a sharp row where most exp arguments fall below float32's normal range).

    python -m bench.sampler_draw [--vocab 262144 49152] [--rows 1] [--threads 1] [--tries 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.execution.sampler import Sampler
from engine.messages import SamplingParams
from engine.types.sequence import Sequence

SETTINGS = {
    "greedy": {"temperature": 0.0},
    "llama.cpp defaults": {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05},
    "gemma": {"temperature": 1.0, "top_k": 64, "top_p": 0.95},
    "qwen": {"temperature": 0.7, "top_k": 20, "top_p": 0.8, "repetition_penalty": 1.05},
    "temperature 1": {"temperature": 1.0},
    "smollm2 card": {"temperature": 0.2, "top_p": 0.9},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, nargs="+", default=[262_144, 49_152])
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tries", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for vocab in args.vocab:
        sampler = Sampler(vocab, [1], torch.device("cpu"))
        logits = torch.randn(args.rows, vocab, generator=torch.Generator().manual_seed(0)) * 3
        for name, fields in SETTINGS.items():
            params = SamplingParams(max_tokens=16, **fields)  # type: ignore[arg-type]
            seqs = [Sequence("r", params, 0.0, list(range(100)), 50) for _ in range(args.rows)]
            times = []
            for _ in range(args.tries):
                t0 = time.perf_counter()
                sampler.sample(logits, seqs)
                times.append(time.perf_counter() - t0)
            print(f"vocab {vocab:>7} rows {args.rows} {name:>20}: {statistics.median(times) * 1e3:7.3f} ms")


if __name__ == "__main__":
    main()
