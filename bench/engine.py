"""Engine-only throughput (no HTTP): decode tok/s at batch 1, 16, 64 and prefill tok/s,
beside `transformers.generate` on the same checkpoint, in one run.

    python -m bench.engine [--model DIR] [--dtype float32] [--threads 2] [--skip-hf]
                           [--temperature 0] [--top-k -1] [--top-p 1] [--repetition-penalty 1]
    python -m bench.engine --tensor-parallel-size 2 [--model DIR] [--new 64]   # TP=2 against TP=1, one thread per rank
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time

import msgspec
import torch

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.messages import AddRequest, SamplingParams


def engine_decode(
    core: EngineCore, batch: int, prompt_len: int, new: int, params: SamplingParams
) -> tuple[float, float]:
    """(tok/s over the whole run, tok/s of the median step): the median shrugs off a noisy neighbour."""
    rng = random.Random(batch)
    for i in range(batch):
        prompt = [rng.randrange(core.vocab_size) for _ in range(prompt_len)]
        core.add_request(AddRequest(f"d{batch}-{i}", prompt, msgspec.structs.replace(params, max_tokens=new), 0.0))
    core.step()  # prefill (all prompts fit one step's budget)
    generated, steps, t0 = 0, [], time.perf_counter()
    while core.has_work:
        t = time.perf_counter()
        n = sum(len(o.new_token_ids) for o in core.step())
        steps.append((time.perf_counter() - t, n))
        generated += n
    full = [dt for dt, n in steps if n == batch]
    return generated / (time.perf_counter() - t0), batch / statistics.median(full or [math.nan])


def engine_prefill(core: EngineCore, n: int, prompt_len: int) -> float:
    rng = random.Random(7)
    for i in range(n):
        prompt = [rng.randrange(core.vocab_size) for _ in range(prompt_len)]
        core.add_request(AddRequest(f"p{i}", prompt, SamplingParams(max_tokens=1, temperature=0.0), 0.0))
    t0 = time.perf_counter()
    while core.has_work:
        core.step()
    return n * prompt_len / (time.perf_counter() - t0)


def hf_decode(model_dir: str, batch: int, prompt_len: int, new: int, dtype: torch.dtype) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len))
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    model.generate(ids, max_new_tokens=2, **kw)  # warm-up
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=1, **kw)
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw)
    return batch * (new - 1) / (time.perf_counter() - t0 - prefill)


def compare_tp(model: str, dtype: str, tp: int, new: int, params: SamplingParams) -> None:
    """Decode tok/s of TP=1 and TP=tp, one thread per rank (engine/distributed/), same batches as above."""
    torch.set_num_threads(1)
    rows: dict[int, list[float]] = {}
    for size in (1, tp):
        core = EngineCore(
            EngineConfig(
                model=model,
                dtype=dtype,
                max_num_seqs=256,
                max_num_batched_tokens=8192,
                enable_prefix_caching=False,
                tensor_parallel_size=size,
            )
        )
        try:
            engine_decode(core, 4, 16, 4, params)  # warm-up
            for batch in (1, 16, 64):
                rows.setdefault(batch, []).append(engine_decode(core, batch, 32, new, params)[1])
        finally:
            close = getattr(core.runner, "close", None)
            if close is not None:
                close()
    print(f"model {model} dtype {dtype}: decode tok/s (median step), one thread per rank")
    print(f"{'batch':>6} {'TP=1':>10} {f'TP={tp}':>10} {'ratio':>7}")
    for batch, (one, many) in rows.items():
        print(f"{batch:>6} {one:>10.1f} {many:>10.1f} {many / one:>7.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the demo checkpoint)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--temperature", type=float, default=0.0, help="engine side only; hf stays greedy")
    ap.add_argument("--top-k", type=int, default=-1)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--repetition-penalty", type=float, default=1.0)
    ap.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="N > 1: decode at TP=N against TP=1, one thread per rank (no hf, no prefill)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.model is None:
        from demo.checkpoints import demo_checkpoint_path

        args.model = str(demo_checkpoint_path())
    if args.tensor_parallel_size > 1:
        compare_tp(
            args.model,
            args.dtype,
            args.tensor_parallel_size,
            args.new,
            SamplingParams(max_tokens=1, temperature=args.temperature, ignore_eos=True),
        )
        return
    core = EngineCore(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
            max_num_seqs=256,
            max_num_batched_tokens=8192,
            enable_prefix_caching=False,
        )
    )
    params = SamplingParams(
        max_tokens=1,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        repetition_penalty=args.repetition_penalty,
        ignore_eos=True,
    )
    engine_decode(core, 4, 16, 4, params)  # warm-up
    print(f"model {args.model} dtype {args.dtype} threads {args.threads} sampling {params}")
    print(f"{'batch':>6} {'engine tok/s':>14} {'(median step)':>14} {'hf generate tok/s':>18} {'ratio':>7}")
    tdtype = getattr(torch, args.dtype)
    for batch in (1, 16, 64):
        ours, median = engine_decode(core, batch, 32, args.new, params)
        hf = float("nan") if args.skip_hf else hf_decode(args.model, batch, 32, args.new, tdtype)
        print(f"{batch:>6} {ours:>14.1f} {median:>14.1f} {hf:>18.1f} {ours / hf:>7.2f}")
    print(f"prefill tok/s (8 x 512 tokens): {engine_prefill(core, 8, 512):.0f}")


if __name__ == "__main__":
    main()
