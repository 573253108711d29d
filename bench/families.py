"""Decode tok/s of every family's demo checkpoint (`spindle make-demo --arch NAME`), in one run, and for the MoE
families the share of each decode step spent routing (router matmul, softmax, top-k) and in the whole MoE block.

    python -m bench.families [--archs qwen2 qwen3 ...] [--new 32] [--dtype float32] [--threads 2]

Demos are built once into the spindle cache (SPINDLE_CACHE_DIR). Ratios are to the Qwen2 demo of the same run;
the families are measured in turn, --rounds times, and each keeps its best round (the machine is shared).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.engine import engine_decode
from demo.checkpoints import FAMILY_DEMOS, make_demo
from engine.cache_root import cache_root
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.layers.moe import SparseMoE
from engine.messages import SamplingParams


def demo_path(arch: str) -> Path:
    path = cache_root() / f"demo-{arch}-v1"
    return path if path.is_dir() else make_demo(path, arch)


class MoETimer:
    """Wraps every MoE block of a model: seconds in routing and in the whole block since the last reset."""

    def __init__(self, model: Any) -> None:
        self.route = self.block = 0.0
        self.blocks = [layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoE)]
        for moe in self.blocks:  # the block calls self.route: an instance attribute shadows the method
            setattr(moe, "route", self._timed(moe.route, "route"))
        for layer in model.layers:
            if isinstance(layer.mlp, SparseMoE):
                layer.mlp = _TimedBlock(layer.mlp, self)

    def _timed(self, fn: Callable[[torch.Tensor], Any], field: str) -> Callable[[torch.Tensor], Any]:
        def run(x: torch.Tensor) -> Any:
            t = time.perf_counter()
            out = fn(x)
            setattr(self, field, getattr(self, field) + time.perf_counter() - t)
            return out

        return run


class _TimedBlock:
    def __init__(self, moe: SparseMoE, timer: MoETimer) -> None:
        self.moe, self.timer = moe, timer

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        t = time.perf_counter()
        out = self.moe(x)
        self.timer.block += time.perf_counter() - t
        return out


def load(arch: str, dtype: str) -> tuple[EngineCore, MoETimer]:
    core = EngineCore(
        EngineConfig(
            model=str(demo_path(arch)),
            dtype=dtype,
            max_num_seqs=256,
            max_num_batched_tokens=8192,
            enable_prefix_caching=False,
        )
    )
    engine_decode(core, 4, 16, 4, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))  # warm-up
    return core, MoETimer(core.runner.model)


def measure(core: EngineCore, timer: MoETimer, new: int) -> dict[str, float]:
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    row: dict[str, float] = {}
    for batch in (1, 64):
        timer.route = timer.block = 0.0
        t0 = time.perf_counter()
        row[f"b{batch}"] = engine_decode(core, batch, 32, new, params)[1]
        elapsed = time.perf_counter() - t0
        if timer.blocks:
            row[f"route{batch}"], row[f"moe{batch}"] = timer.route / elapsed, timer.block / elapsed
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--archs", nargs="*", default=list(FAMILY_DEMOS))
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="families measured in turn this often; best kept")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    archs = ["qwen2"] + [a for a in args.archs if a != "qwen2"]
    loaded = {arch: load(arch, args.dtype) for arch in archs}
    rows: dict[str, dict[str, float]] = {}
    for _ in range(args.rounds):  # in turn, so a noisy neighbour slows every family alike; the best round is kept
        for arch, (core, timer) in loaded.items():
            row = measure(core, timer, args.new)
            if arch not in rows or row["b1"] + row["b64"] / 8 > rows[arch]["b1"] + rows[arch]["b64"] / 8:
                rows[arch] = row
    base = rows["qwen2"]
    print(f"dtype {args.dtype} threads {args.threads}: decode tok/s (median step); x = ratio to the qwen2 demo")
    print(
        f"{'family':>10} {'batch 1':>9} {'x':>5} {'batch 64':>9} {'x':>5} {'routing b1/b64':>15} "
        f"{'MoE block b1/b64':>17}"
    )
    for arch, r in rows.items():
        moe = f"{r['route1']:>7.1%}/{r['route64']:<7.1%} {r['moe1']:>8.1%}/{r['moe64']:<8.1%}" if "route1" in r else ""
        print(
            f"{arch:>10} {r['b1']:>9.1f} {r['b1'] / base['b1']:>5.2f} {r['b64']:>9.1f} "
            f"{r['b64'] / base['b64']:>5.2f} {moe}"
        )


if __name__ == "__main__":
    main()
