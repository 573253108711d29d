"""One decode step's projections on a real shape, per Linear form, in CPU ms (engine/layers/linear.py).

    python -m bench.linear [--model DIR] [--rows 1 16 64] [--threads 1] [--tries 5]

Every projection of every layer (fused q|k|v, o, fused gate|up, down) at the model's shapes (default
Qwen2.5-0.5B's), random bfloat16 weights, for each form: `F.linear` on the [out, in] weight as loaded,
spindle's own kernel (engine/cpu_kernels, what bfloat16 uses on CPU where it builds) on bf16 and on int8
weights, oneDNN with the weight pre-packed (the fallback), ATen's weight-only int8 (`--quantization int8`
without the kernel), float32 `F.linear`, and "chosen": what make_linear holds on this machine (the form
engine/cpu_kernels/chooser.py measures fastest; each call takes its row class's winner). Times are the process's CPU
time, best of --tries, the forms interleaved, so a
machine shared with other work still gives fair ratios. Also: GB/s over the bf16 weight bytes, GFLOP/s.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench.roofline import load_args
from demo.shapes import SHAPES
from engine.cpu_kernels import gemm
from engine.hugepages import reexec_with_huge_pages
from engine.layers.linear import Int8Linear, Linear, PackedLinear, make_linear, packed_weight
from engine.models.args import ModelArgs
from engine.models.registry import parse_config


def shapes(args: ModelArgs) -> list[tuple[int, int]]:
    """[out, in] of one layer's projections."""
    h, d = args.hidden_size, args.head_dim
    return [
        ((args.num_heads + 2 * args.num_kv_heads) * d, h),
        (h, args.num_heads * d),
        (2 * args.intermediate_size, h),
        (h, args.intermediate_size),
    ]


class Float32Linear(Linear):
    """float32 weights and activations (the CPU default, --dtype auto)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__(weight.float())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight)


class ThreadedKernel:
    """engine/cpu_kernels/gemm.py at a fixed thread count (the engine picks it per call)."""

    def __init__(self, weight: torch.Tensor, threads: int, quantization: str | None = None) -> None:
        self.packed, self.threads = packed_weight(weight, None, quantization), threads

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.packed(x, self.threads)


def forms(weights: list[torch.Tensor], threads: int) -> dict[str, list[Callable[[torch.Tensor], torch.Tensor]]]:
    kernel: dict[str, list[Callable[[torch.Tensor], torch.Tensor]]] = (
        {
            "kernel bf16": [ThreadedKernel(w, threads) for w in weights],
            "kernel int8": [ThreadedKernel(w, threads, "int8") for w in weights],
        }
        if gemm.available()
        else {}
    )
    return {
        **kernel,
        "F.linear bf16": [Linear(w) for w in weights],
        "packed bf16": [PackedLinear(w) for w in weights],
        "int8": [Int8Linear(w) for w in weights],
        "F.linear fp32": [Float32Linear(w) for w in weights],
        "chosen bf16": [make_linear(w) for w in weights],
    }


def main() -> None:
    reexec_with_huge_pages()  # as the engine process runs (engine/hugepages.py)
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="a checkpoint folder (its config.json); default Qwen2.5-0.5B's")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tries", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    args = load_args(a.model) if a.model else parse_config(SHAPES["qwen2.5-0.5b"])
    g = torch.Generator().manual_seed(0)
    weights = [
        (torch.randn(o, i, generator=g) / i**0.5).to(torch.bfloat16)
        for _ in range(args.num_layers)
        for o, i in shapes(args)
    ]
    nbytes = sum(w.nbytes for w in weights)
    with torch.inference_mode():
        fns = forms(weights, a.threads)
        print(
            f"{args.num_layers} layers x 4 projections, {nbytes / 1e6:.0f} MB in bf16, {a.threads} thread(s), "
            f"CPU ms per step (best of {a.tries})"
        )
        for rows in a.rows:
            xs = [torch.randn(rows, w.shape[1], generator=g).to(torch.bfloat16) for w in weights]
            best = {name: float("inf") for name in fns}
            for _ in range(a.tries + 1):  # the first round warms up
                for name, lins in fns.items():
                    c0 = time.process_time()
                    for lin, x in zip(lins, xs):
                        lin(x)
                    best[name] = min(best[name], time.process_time() - c0)
            flops = 2 * rows * nbytes / 2
            print(
                f"rows {rows:>3}: "
                + "  ".join(
                    f"{n} {t * 1e3:6.1f} ms ({nbytes / t / 1e9:4.1f} GB/s, {flops / t / 1e9:4.0f} GFLOP/s)"
                    for n, t in best.items()
                )
            )


if __name__ == "__main__":
    main()
