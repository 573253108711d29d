"""Where a decode step's time goes, through EngineCore.step: schedule / prepare inputs / forward /
LM head / sample / postprocess (RequestOutputs, scheduler.update, stop checks), in ms per step.

    python -m bench.profile_step [--model DIR|FILE.gguf] [--batch 64] [--dtype auto] [--threads 2] [--steps 30]
                                 [--temperature 0] [--top-k -1] [--repetition-penalty 1] [--torch-profile]
                                 [--quantization int8] [--repeat 1]

Phases are timed by wrapping the methods EngineCore.step calls (no change to the engine);
postprocess is the step's remainder. --torch-profile also prints torch.profiler's top ops.
Each step's time is also given as a ratio to the roofline bound (bench/roofline.py), with the machine's
rates measured in the same run, right before the steps (best over 1..--threads threads): the mean step
("step/bound") and the median one ("median/bound", which a few steps slowed by another process on the
machine leave alone). On CPU the rates are measured again right after the steps ("probe after"): on a shared
machine whose bandwidth swings, a ratio whose two probes disagree came from the probe as much as the steps.
With several rounds (--repeat) the last line sums them up: the median over rounds of each round's median step
against the tighter of its two probes' bounds (many short rounds, e.g. --steps 6 --repeat 20, pair each step
with the machine's rates at that moment).
The cyclic GC is frozen after load, as the engine process does.
"""

from __future__ import annotations

import argparse
import functools
import gc
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from bench.roofline import Rates, gguf_tensor_bytes, load_args, measure, measure_gpu, step_cost
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.cpu_kernels import chooser
from engine.hugepages import reexec_with_huge_pages
from engine.messages import AddRequest, SamplingParams
from engine.models.loader import resolve_model

PHASES = ("schedule", "prepare", "forward", "lm_head", "sample")


def _timed(totals: dict[str, float], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - t0
            totals[name + "/cpu"] += time.process_time() - c0

    return wrapper


def instrument(core: EngineCore, totals: dict[str, float]) -> None:
    """Wrap the step's phases on this core's objects (instance attributes shadow the methods)."""
    runner = core.runner
    core.scheduler.schedule = _timed(totals, "schedule", core.scheduler.schedule)  # type: ignore[method-assign]
    core.scheduler.update = _timed(totals, "update", core.scheduler.update)  # type: ignore[method-assign]
    prepare = "prepare" if hasattr(runner, "prepare") else "_metadata"
    setattr(runner, prepare, _timed(totals, "prepare", getattr(runner, prepare)))
    runner.model.forward = _timed(totals, "forward", runner.model.forward)  # type: ignore[method-assign]
    runner.model.compute_logits = _timed(
        totals,
        "lm_head",  # type: ignore[method-assign]
        runner.model.compute_logits,
    )
    core.sampler.sample = _timed(totals, "sample", core.sampler.sample)  # type: ignore[method-assign]


def instrument_forward(core: EngineCore, totals: dict[str, float]) -> None:
    """Inside forward: the projections ("linear") and attention ("attention"), wrapped per layer object."""
    model = core.runner.model
    for layer in getattr(model, "layers", []):
        for owner in (layer, getattr(layer, "mlp", None)):  # a dense MLP holds gate_up and down
            for name in ("qkv", "o", "gate_up", "down"):
                if hasattr(owner, name) and callable(getattr(owner, name)):
                    setattr(owner, name, _timed(totals, "linear", getattr(owner, name)))
    ops = model.ops
    model.ops = type("TimedOps", (ops,), {"attention": staticmethod(_timed(totals, "attention", ops.attention))})


def add_batch(core: EngineCore, batch: int, prompt_len: int, params: SamplingParams) -> None:
    rng = random.Random(batch)
    for i in range(batch):
        prompt = [rng.randrange(core.vocab_size) for _ in range(prompt_len)]
        core.add_request(AddRequest(f"prof-{i}", prompt, params, 0.0))


def best_rates(dtype: str, threads: int) -> Rates:
    """The machine's best read bandwidth and GEMM rate over 1..threads threads, measured now."""
    runs = [measure(dtype, n, read_mib=512, tries=4) for n in range(1, threads + 1)]
    return Rates(
        threads,
        max(r.read_gbs for r in runs),
        max(r.peak_gflops for r in runs),
        runs[0].read_gbs_cpu,
        runs[0].peak_gflops_cpu,
    )


def timed_steps(core: EngineCore, steps: int, totals: dict[str, float]) -> tuple[float, dict[str, float]]:
    """(seconds for `steps` steps, ms per step of each phase, "cpu": the process's CPU ms per step, "median":
    the median step's ms); `totals` is what instrument() fills."""
    totals.clear()
    times = []
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        s0 = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - s0)
    total = time.perf_counter() - t0
    ms = {k: v / steps * 1e3 for k, v in totals.items()}
    ms["cpu"] = (time.process_time() - c0) / steps * 1e3
    ms["median"] = statistics.median(times) * 1e3
    ms["postprocess"] = total / steps * 1e3 - sum(ms[p] for p in (*PHASES, "update") if p in ms) + ms.get("update", 0.0)
    return total, ms


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the demo checkpoint)")
    ap.add_argument("--dtype", default="auto", help="as the server's --dtype (auto: what it picks)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeat", type=int, default=1, help="rounds of (measure the machine, run --steps steps)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-k", type=int, default=-1)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--repetition-penalty", type=float, default=1.0)
    ap.add_argument("--quantization", default=None, choices=("int8",))
    ap.add_argument("--no-roofline", action="store_true", help="skip measuring the machine")
    ap.add_argument("--split-projections", action="store_true", help="cut big projections over the threads")
    ap.add_argument("--device", default="auto", help="auto (cuda when there is one), cpu or cuda")
    ap.add_argument("--split-forward", action="store_true", help="also time projections and attention in forward")
    ap.add_argument(
        "--threaded-step-flops",
        type=float,
        default=None,
        help="EngineConfig.threaded_step_flops (torch's ops on all threads from this step size)",
    )
    ap.add_argument("--torch-profile", action="store_true")
    return ap.parse_args()


def print_kernel_choices(core: EngineCore) -> None:
    """The CPU kernel chosen per projection shape and row class (engine/cpu_kernels/chooser.py), and whether
    decode steps run the fused layer."""
    for kind, shape, winners in chooser.choices_made():
        print(
            f"{'kernels':>12} {kind} {'x'.join(map(str, shape))}: "
            + " ".join(f"{cls}:{w}" for cls, w in zip(chooser.describe_classes().split(), winners))
        )
    fused = getattr(core.runner.model, "fused", None)
    print(f"{'fused decode':>12} {'built' if fused is not None else 'off'}")


def main() -> None:
    reexec_with_huge_pages()  # as the engine process runs (engine/hugepages.py)
    args = parse_args()
    torch.set_num_threads(args.threads)
    if args.model is None:
        from demo.checkpoints import demo_checkpoint_path

        args.model = str(demo_checkpoint_path())
    extra: dict[str, Any] = {"quantization": args.quantization} if args.quantization else {}
    if args.split_projections:
        extra["split_projections"] = True
    if args.threaded_step_flops is not None:
        extra["threaded_step_flops"] = args.threaded_step_flops
    core = EngineCore(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
            max_num_seqs=256,
            device=args.device,
            max_num_batched_tokens=8192,
            enable_prefix_caching=False,
            **extra,
        )
    )
    gc.freeze()  # as engine/core/loop.py does once the model is loaded
    gpu = core.runner.device.type == "cuda"
    params = SamplingParams(
        max_tokens=args.steps * args.repeat + 16,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        repetition_penalty=args.repetition_penalty,
        ignore_eos=True,
    )
    prompt_len = 128
    add_batch(core, args.batch, prompt_len, params)
    for _ in range(4):  # the prefill, then warm-up decodes
        core.step()
    print(
        f"batch {args.batch} dtype {args.dtype} threads {args.threads} temperature {args.temperature} "
        f"top_k {args.top_k} top_p {args.top_p} repetition_penalty {args.repetition_penalty} "
        f"quantization {args.quantization} device {core.runner.device}"
    )
    print_kernel_choices(core)
    model_dtype = core.runner.model_dtype
    totals: dict[str, float] = defaultdict(float)
    instrument(core, totals)
    if args.split_forward:
        instrument_forward(core, totals)
    paired: list[float] = []  # each round's median step / the tighter of its two probes' bounds
    for r in range(args.repeat):
        rates = (
            None
            if args.no_roofline
            else measure_gpu(model_dtype, str(core.runner.device))
            if gpu
            else best_rates(model_dtype, args.threads)
        )
        total, ms = timed_steps(core, args.steps, totals)
        for name in (*PHASES, "postprocess"):
            cpu = f"  (cpu {ms[name + '/cpu']:.2f} ms)" if name + "/cpu" in ms else ""
            print(f"{name:>12} {ms.get(name, 0.0):8.2f} ms{cpu}")
            if name == "forward" and "linear" in ms:
                for part in ("linear", "attention"):
                    print(f"{'. ' + part:>12} {ms[part]:8.2f} ms  (cpu {ms[part + '/cpu']:.2f} ms)")
        print(f"{'(update)':>12} {ms.get('update', 0.0):8.2f} ms  (inside postprocess)")
        step_ms = total / args.steps * 1e3
        print(
            f"{'step':>12} {step_ms:8.2f} ms  -> {args.batch * args.steps / total:.0f} tok/s  "
            f"(median step {ms['median']:.2f} ms)"
        )
        if rates is not None:
            context = prompt_len + 4 + r * args.steps + args.steps // 2  # the mean over these steps
            folder = resolve_model(args.model)  # a .gguf file: the folder derived from it
            cost = step_cost(
                load_args(folder), model_dtype, args.batch, context, args.quantization, gguf_tensor_bytes(folder)
            )
            bound, why = cost.bound_ms(rates)
            print(
                f"{'bound':>12} {bound:8.2f} ms  ({why}; read {rates.read_gbs:.1f} GB/s, "
                f"GEMM {rates.peak_gflops:.0f} GFLOP/s)  step/bound {step_ms / bound:.2f}  "
                f"median/bound {ms['median'] / bound:.2f}"
            )
            if gpu:
                continue
            after = best_rates(model_dtype, args.threads)
            bound_after, why_after = cost.bound_ms(after)
            print(
                f"{'probe after':>12} {bound_after:8.2f} ms  ({why_after}; read {after.read_gbs:.1f} GB/s, "
                f"GEMM {after.peak_gflops:.0f} GFLOP/s)  median/bound {ms['median'] / bound_after:.2f}"
            )
            paired.append(ms["median"] / min(bound, bound_after))
            cpu_bound, why = cost.bound_ms(rates, cpu=True)
            print(
                f"{'cpu time':>12} {ms['cpu']:8.2f} ms, bound {cpu_bound:.2f} ms of one core ({why}; "
                f"{rates.read_gbs_cpu:.1f} GB and {rates.peak_gflops_cpu:.0f} GFLOP per CPU s)  "
                f"cpu/bound {ms['cpu'] / cpu_bound:.2f}"
            )
    if len(paired) > 1:
        print(
            f"over {len(paired)} rounds: median step / the tighter probe's bound: median "
            f"{statistics.median(paired):.2f} (range {min(paired):.2f}-{max(paired):.2f})"
        )
    if args.torch_profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                core.step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


if __name__ == "__main__":
    main()
