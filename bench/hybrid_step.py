"""A hybrid model's decode step against the memory bound, and its prefill rate, through EngineCore.step.

    python -m bench.hybrid_step --model DIR [--threads 1 2] [--batch 1 16] [--steps 20] [--prompt 512]
                                [--profile] [--threaded-step-flops F]

Build the checkpoints with `spindle make-demo --shape qwen3.5-0.8b DIR` or `--shape lfm2-1.2b DIR` (bf16).
Decode: `batch` sequences of 32-token prompts, a few warm-up steps, then `--steps` steps timed (wall and this
process's CPU time). The bound: the bytes a step reads (every weight once: the checkpoint's tensors, a tied
embedding counted once as the LM head, an untied one not at all as only its rows are read; each sequence's
recurrent state read and written; the attention layers' KV at the mean context) over the read bandwidth that
bench/roofline.py measures right before the steps (the best over 1..threads threads); and the step's CPU time
against the same bytes over one thread's read rate per CPU second (steady while other processes take turns on
the cores, as bench/profile_step.py's "cpu time" line). Prefill: one
`--prompt`-token request to its first token. The load average goes beside each figure: the machine is shared.
--profile: ms per step by layer kind (recurrent mixers, their recurrent kernel, attention, MLP, LM head).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.roofline import measure
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.messages import AddRequest, SamplingParams
from engine.models.hybrid import AttnBlock, HybridLM, Mixer, RecurrentBlock
from engine.models.recurrent.state import StateBatch, StateShape, slot_bytes

DECODE_PROMPT = 32


def weight_bytes(folder: Path) -> int:
    """Bytes a decode step reads of the checkpoint: every tensor (safetensors headers), less an untied
    embedding (a step reads only its rows)."""
    sizes: dict[str, int] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with f.open("rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        sizes.update({n: t["data_offsets"][1] - t["data_offsets"][0] for n, t in header.items() if n != "__metadata__"})
    untied_embed = sizes.get("model.embed_tokens.weight", 0) if "lm_head.weight" in sizes else 0
    return sum(sizes.values()) - untied_embed


def step_bytes(core: EngineCore, weights: int, batch: int, context: int) -> int:
    """Weights once, each sequence's recurrent state read and written, the attention layers' KV at `context`."""
    model = core.runner.model
    assert isinstance(model, HybridLM), "bench.hybrid_step measures hybrid models"
    a = model.args
    state = 2 * slot_bytes(model.state_shapes()) * batch
    kv = batch * context * model.num_kv_layers * 2 * a.num_kv_heads * a.head_dim * model.dtype.itemsize
    return weights + state + kv


def _timed(totals: dict[str, float], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - t0

    return wrapper


class _TimedMixer:
    """A recurrent mixer timed as a whole (the block calls it; its state shapes pass through)."""

    def __init__(self, mixer: Mixer, totals: dict[str, float]) -> None:
        self.mixer, self.totals = mixer, totals
        self.name = "mixer " + type(mixer).__name__
        for kernel in ("_rule", "_scan"):  # the recurrent kernel inside, where the mixer has one
            if hasattr(mixer, kernel):
                setattr(mixer, kernel, _timed(totals, f". {kernel} (in {self.name})", getattr(mixer, kernel)))

    def state_shapes(self, dtype: torch.dtype) -> list[StateShape]:
        return self.mixer.state_shapes(dtype)

    def __call__(self, h: torch.Tensor, state: tuple[torch.Tensor, ...], sb: StateBatch) -> torch.Tensor:
        t0 = time.perf_counter()
        try:
            return self.mixer(h, state, sb)
        finally:
            self.totals[self.name] += time.perf_counter() - t0


def instrument(model: HybridLM, totals: dict[str, float]) -> None:
    """Time each layer kind: recurrent mixers, attention, MLPs, the LM head (instance attributes shadow)."""
    model.attend = _timed(totals, "attention", model.attend)  # type: ignore[method-assign]
    model.compute_logits = _timed(totals, "lm_head", model.compute_logits)  # type: ignore[method-assign]
    model.forward = _timed(totals, "forward", model.forward)  # type: ignore[method-assign]
    for b in model.blocks:
        b.mlp = _timed(totals, "mlp", b.mlp)
        if isinstance(b, RecurrentBlock):
            b.mixer = _TimedMixer(b.mixer, totals)
        assert isinstance(b, AttnBlock | RecurrentBlock)


def new_core(model: str, threaded_step_flops: float | None) -> EngineCore:
    extra: dict[str, Any] = {} if threaded_step_flops is None else {"threaded_step_flops": threaded_step_flops}
    core = EngineCore(
        EngineConfig(
            model=model, dtype="bfloat16", max_num_seqs=64, max_num_batched_tokens=4096, enable_prefix_caching=False,
            **extra,
        )
    )  # fmt: skip
    gc.freeze()  # as engine/core/loop.py does once the model is loaded
    return core


def prefill(core: EngineCore, prompt: int, seed: int) -> tuple[float, float]:
    """(wall s, CPU s) for one `prompt`-token request to its first token."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, min(core.vocab_size, 60_000), (prompt,), generator=g).tolist()
    core.add_request(AddRequest(f"pre-{seed}", ids, SamplingParams(max_tokens=1, ignore_eos=True), 0.0))
    t0, c0 = time.perf_counter(), time.process_time()
    while core.has_work:
        core.step()
    return time.perf_counter() - t0, time.process_time() - c0


def decode(
    core: EngineCore, batch: int, steps: int, seed: int, totals: dict[str, float]
) -> tuple[list[float], float, dict[str, float]]:
    """(each timed step's wall s, CPU s per step, `totals`' ms per timed step) over `steps` decode steps of
    `batch` sequences."""
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        ids = torch.randint(3, min(core.vocab_size, 60_000), (DECODE_PROMPT,), generator=g).tolist()
        core.add_request(AddRequest(f"dec-{seed}-{i}", ids, params, 0.0))
    for _ in range(4):  # the prefill, then warm-up decodes
        core.step()
    times = []
    totals.clear()
    c0 = time.process_time()
    for _ in range(steps):
        s0 = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - s0)
    cpu = (time.process_time() - c0) / steps
    parts = {k: v / steps * 1e3 for k, v in totals.items()}
    while core.has_work:
        core.step()
    return times, cpu, parts


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a hybrid checkpoint folder (spindle make-demo --shape ...)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompt", type=int, default=512, help="the prefill's prompt length")
    ap.add_argument("--profile", action="store_true", help="ms per step by layer kind")
    ap.add_argument("--threaded-step-flops", type=float, default=None, help="EngineConfig.threaded_step_flops")
    return ap.parse_args()


def _load() -> str:
    return "load " + " ".join(f"{x:.1f}" for x in os.getloadavg())


def run_threads(core: EngineCore, a: argparse.Namespace, threads: int, weights: int, totals: dict[str, float]) -> None:
    torch.set_num_threads(threads)
    print(f"-- {threads} thread(s); {_load()}")
    wall, cpu = prefill(core, a.prompt, threads)
    print(
        f"prefill {a.prompt} tokens: {wall:.2f} s -> {a.prompt / wall:.0f} tok/s (cpu {cpu:.2f} s -> "
        f"{a.prompt / cpu:.0f} tok per CPU s); {_load()}"
    )
    for batch in a.batch:
        runs = [measure("bfloat16", n, read_mib=512, tries=4) for n in range(1, threads + 1)]
        read_gbs, read_cpu = max(r.read_gbs for r in runs), runs[0].read_gbs_cpu  # GB per CPU s: one thread's
        times, cpu_s, parts = decode(core, batch, a.steps, batch * 100 + threads, totals)
        mean, median = statistics.mean(times) * 1e3, statistics.median(times) * 1e3
        nbytes = step_bytes(core, weights, batch, DECODE_PROMPT + 4 + a.steps // 2)
        bound, cpu_bound = nbytes / (read_gbs * 1e9) * 1e3, nbytes / (read_cpu * 1e9) * 1e3
        print(
            f"decode batch {batch:>2}: mean {mean:7.2f} ms, median {median:7.2f} ms -> {batch * 1e3 / mean:.1f} tok/s"
            f" | bound {bound:.2f} ms ({nbytes / 1e6:.0f} MB at {read_gbs:.1f} GB/s) median/bound "
            f"{median / bound:.2f} | cpu {cpu_s * 1e3:.2f} ms/step, bound {cpu_bound:.2f} ms of one core "
            f"({read_cpu:.1f} GB per CPU s) cpu/bound {cpu_s * 1e3 / cpu_bound:.2f}; {_load()}"
        )
        for name, ms in sorted(parts.items(), key=lambda kv: -kv[1]):
            print(f"    {name:<44} {ms:8.2f} ms/step")


def main() -> None:
    a = parse_args()
    core = new_core(a.model, a.threaded_step_flops)
    totals: dict[str, float] = defaultdict(float)
    if a.profile:
        model = core.runner.model
        assert isinstance(model, HybridLM)
        instrument(model, totals)
    weights = weight_bytes(Path(a.model))
    print(f"{a.model}: {weights / 1e6:.0f} MB of weights read per step; torch {torch.__version__}")
    for threads in a.threads:
        run_threads(core, a, threads, weights, totals)


if __name__ == "__main__":
    main()
