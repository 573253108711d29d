"""Embedding throughput (no HTTP): inputs per second at batch 1 and 64 for 128-token inputs, `--runner pooling`
(LAST pooling, normalized) beside transformers' AutoModel on the same checkpoint (last_hidden_state, the same
pooling), in one run.

    python -m bench.embed [--model DIR] [--dtype float32] [--threads 2] [--len 128] [--rounds 3] [--skip-hf]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
import torch.nn.functional as F

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.messages import AddRequest, SamplingParams


def engine_embed(core: EngineCore, batch: int, length: int, rounds: int) -> float:
    """Inputs per second: `batch` inputs added at once, stepped until all are embedded; the median round."""
    rng = random.Random(batch)
    times = []
    for r in range(rounds + 1):  # round 0 warms up
        prompts = [[rng.randrange(core.vocab_size) for _ in range(length)] for _ in range(batch)]
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            core.add_request(AddRequest(f"e{batch}-{r}-{i}", p, SamplingParams(max_tokens=1), 0.0))
        done = 0
        while core.has_work:
            done += sum(o.pooled is not None for o in core.step())
        assert done == batch
        if r:
            times.append(time.perf_counter() - t0)
    return batch / statistics.median(times)


def hf_embed(model_dir: str, batch: int, length: int, rounds: int, dtype: torch.dtype) -> float:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, dtype=dtype).eval()
    times = []
    with torch.inference_mode():
        for r in range(rounds + 1):
            ids = torch.randint(0, model.config.vocab_size, (batch, length))
            t0 = time.perf_counter()
            hidden = model(ids).last_hidden_state
            F.normalize(hidden[:, -1].float(), dim=-1).tolist()
            if r:
                times.append(time.perf_counter() - t0)
    return batch / statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the demo checkpoint)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--len", type=int, default=128, help="tokens per input")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.model is None:
        from engine.models.random_checkpoint import demo_checkpoint_path

        args.model = str(demo_checkpoint_path())
    # 64 x 128 tokens in one step, as transformers' single forward pass
    core = EngineCore(EngineConfig(model=args.model, dtype=args.dtype, runner="pooling", device=args.device,
                                   max_num_batched_tokens=max(2048, 64 * args.len)))
    print(f"model {args.model} dtype {args.dtype} threads {args.threads} device {core.runner.device} "
          f"input {args.len} tokens")
    for batch in (1, 64):
        line = f"batch {batch:3d}: spindle {engine_embed(core, batch, args.len, args.rounds):8.1f} inputs/s"
        if not args.skip_hf:
            hf = hf_embed(args.model, batch, args.len, args.rounds, getattr(torch, args.dtype))
            line += f"   transformers {hf:8.1f} inputs/s"
        print(line, flush=True)


if __name__ == "__main__":
    main()
