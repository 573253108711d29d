"""Where a decode step's time goes, through EngineCore.step: schedule / prepare inputs / forward /
LM head / sample / postprocess (RequestOutputs, scheduler.update, stop checks), in ms per step.

    python -m bench.profile_step [--batch 64] [--dtype float32] [--threads 2] [--steps 30]
                                 [--temperature 0] [--top-k -1] [--repetition-penalty 1] [--torch-profile]

Phases are timed by wrapping the methods EngineCore.step calls (no change to the engine);
postprocess is the step's remainder. --torch-profile also prints torch.profiler's top ops.
"""

from __future__ import annotations

import argparse
import functools
import random
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.messages import AddRequest, SamplingParams

PHASES = ("schedule", "prepare", "forward", "lm_head", "sample")


def _timed(totals: dict[str, float], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - t0
    return wrapper


def instrument(core: EngineCore, totals: dict[str, float]) -> None:
    """Wrap the step's phases on this core's objects (instance attributes shadow the methods)."""
    runner = core.runner
    core.scheduler.schedule = _timed(totals, "schedule", core.scheduler.schedule)  # type: ignore[method-assign]
    core.scheduler.update = _timed(totals, "update", core.scheduler.update)  # type: ignore[method-assign]
    prepare = "prepare" if hasattr(runner, "prepare") else "_metadata"
    setattr(runner, prepare, _timed(totals, "prepare", getattr(runner, prepare)))
    runner.model.forward = _timed(totals, "forward", runner.model.forward)  # type: ignore[method-assign]
    runner.model.compute_logits = _timed(totals, "lm_head",  # type: ignore[method-assign]
                                         runner.model.compute_logits)
    core.sampler.sample = _timed(totals, "sample", core.sampler.sample)  # type: ignore[method-assign]


def add_batch(core: EngineCore, batch: int, prompt_len: int, params: SamplingParams) -> None:
    rng = random.Random(batch)
    for i in range(batch):
        prompt = [rng.randrange(core.vocab_size) for _ in range(prompt_len)]
        core.add_request(AddRequest(f"prof-{i}", prompt, params, 0.0))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the demo checkpoint)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-k", type=int, default=-1)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--repetition-penalty", type=float, default=1.0)
    ap.add_argument("--torch-profile", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.model is None:
        from engine.models.random_checkpoint import demo_checkpoint_path
        args.model = str(demo_checkpoint_path())
    core = EngineCore(EngineConfig(model=args.model, dtype=args.dtype, max_num_seqs=256,
                                   max_num_batched_tokens=8192, enable_prefix_caching=False))
    params = SamplingParams(max_tokens=args.steps + 8, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, repetition_penalty=args.repetition_penalty, ignore_eos=True)
    add_batch(core, args.batch, 128, params)
    for _ in range(4):  # the prefill, then warm-up decodes
        core.step()
    totals: dict[str, float] = defaultdict(float)
    instrument(core, totals)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        core.step()
    total = time.perf_counter() - t0
    ms = {k: v / args.steps * 1e3 for k, v in totals.items()}
    ms["postprocess"] = total / args.steps * 1e3 - sum(ms[p] for p in (*PHASES, "update") if p in ms) \
        + ms.get("update", 0.0)
    print(f"batch {args.batch} dtype {args.dtype} threads {args.threads} temperature {args.temperature} "
          f"top_k {args.top_k} top_p {args.top_p} repetition_penalty {args.repetition_penalty}")
    for name in (*PHASES, "postprocess"):
        print(f"{name:>12} {ms.get(name, 0.0):8.2f} ms")
    print(f"{'(update)':>12} {ms.get('update', 0.0):8.2f} ms  (inside postprocess)")
    print(f"{'step':>12} {total / args.steps * 1e3:8.2f} ms  -> {args.batch * args.steps / total:.0f} tok/s")
    if args.torch_profile:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                core.step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


if __name__ == "__main__":
    main()
