"""Constrained decoding cost: engine decode tok/s at batch 1, 16, 64 with a 20-property JSON schema against
no constraint, on the same checkpoint in one run, and the schema's compile time.

    python -m bench.guided [--model DIR] [--threads 2] [--new 256]

Greedy; the unconstrained requests ignore eos so both run `--new` tokens (a random model's object lasts about
that long: its numbers are unbounded, and the engine finishes the object just inside max_tokens, which
engine/structured/forced_finish.py looks for while it decodes). Plain and constrained runs alternate, twice each, and
the better of each pair is kept: a later run on the same engine is slower whatever it runs (the KV blocks it gets
are more scattered), so one order alone would bias the ratio.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import time

import torch

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.messages import AddRequest, SamplingParams, StructuredOutputs

_IDS = itertools.count()


def schema() -> dict[str, object]:
    kinds: list[dict[str, object]] = [
        {"type": "string", "maxLength": 16},
        {"type": "integer", "minimum": 0, "maximum": 100000},
        {"type": "boolean"},
        {"enum": ["red", "green", "blue"]},
        {"type": "number"},
    ]
    props = {f"field_{i}": kinds[i % len(kinds)] for i in range(20)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def decode(core: EngineCore, batch: int, new: int, so: StructuredOutputs | None) -> tuple[float, float]:
    """(tok/s over the decode steps, tok/s of the median full step)."""
    rng = random.Random(batch)
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=so is None, structured_outputs=so)
    for _ in range(batch):
        prompt = [rng.randrange(core.vocab_size) for _ in range(32)]
        core.add_request(AddRequest(f"g{next(_IDS)}", prompt, params, 0.0))
    started = 0
    while started < batch:  # prefill (and, the first time, the compile)
        started += sum(1 for o in core.step() if o.new_token_ids and o.logprobs is None)
    generated, steps, t0 = 0, [], time.perf_counter()
    while core.has_work:
        t = time.perf_counter()
        n = sum(len(o.new_token_ids) for o in core.step())
        steps.append((time.perf_counter() - t, n))
        generated += n
    full = [dt for dt, n in steps if n == batch] or [dt for dt, _ in steps]
    return generated / (time.perf_counter() - t0), batch / statistics.median(full)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the demo checkpoint)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new", type=int, default=256)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.model is None:
        from demo.checkpoints import demo_checkpoint_path

        args.model = str(demo_checkpoint_path())
    core = EngineCore(
        EngineConfig(model=args.model, max_num_seqs=256, max_num_batched_tokens=8192, enable_prefix_caching=False)
    )
    so = StructuredOutputs("json", json.dumps(schema()))
    t0 = time.perf_counter()
    backend = core.structured.backend()
    t1 = time.perf_counter()
    backend.compile(so)
    t2 = time.perf_counter()
    print(f"model {args.model} threads {args.threads}")
    print(
        f"tokenizer for llguidance: {t1 - t0:.2f} s (once per engine); 20-property schema compile: "
        f"{(t2 - t1) * 1000:.1f} ms"
    )
    decode(core, 4, 8, None)  # warm-up, and the schema's compile into the cache
    decode(core, 4, 8, so)
    print(f"{'batch':>6} {'plain tok/s':>12} {'(median)':>9} {'schema tok/s':>13} {'(median)':>9} {'ratio':>6}")
    for batch in (1, 16, 64):
        runs = [decode(core, batch, args.new, c) for c in (None, so, so, None)]
        plain, plain_med = max(runs[0], runs[3], key=lambda r: r[1])
        guided, guided_med = max(runs[1], runs[2], key=lambda r: r[1])
        print(
            f"{batch:>6} {plain:>12.1f} {plain_med:>9.1f} {guided:>13.1f} {guided_med:>9.1f} "
            f"{guided_med / plain_med:>6.2f}"
        )


if __name__ == "__main__":
    main()
