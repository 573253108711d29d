"""The bf16 GEMM kernel against another build of it, products alone, alternated in one process.

    python -m bench.gemm_ab OTHER.so [--shapes 1x9728x896 16x151936x896 ...] [--threads 2] [--rounds 15]
    python -m bench.gemm_ab OTHER.so --step MODEL_DIR [--rows 1 16]

OTHER.so: another build of engine/cpu_kernels (e.g. an older commit's library from the spindle cache,
~/.cache/spindle/cpu_kernels/spindle-*.so, copied aside before the sources change). Each shape is MxNxK
(rows, outputs, inputs). Up to 32 rows the products rotate over enough copies of the weights (~256 MB) that
they come from memory, as in a decode step; more rows use one copy (a prefill's products are compute-bound).
Each round times both libraries (best of two passes each); printed: the medians in ms, this build's GFLOP/s,
and the median of the per-round ratios this / other (below 1: this build is faster). On a shared machine
only the ratio means much.

--step MODEL_DIR: instead, the products of one decode step of that checkpoint's shape (config.json only;
random bf16 weights), in the engine's order: per layer q|k|v, o, the gated MLP's gate|up (one call, SiLU and
product fused) and down, then the LM head into float32 logits; the weights come from memory as in a step.
Printed per --rows: each library's median step and its parts, and the median per-round ratio this / other.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from collections.abc import Callable
from typing import Any, cast

import torch

from bench.roofline import load_args
from engine.cpu_kernels import build, gemm
from engine.hugepages import reexec_with_huge_pages

Product = Callable[[int, int, int, int, int, int, int, int, int, int, int, int, int], None]
Gated = Callable[[int, int, int, int, int, int, int, int, int, int, int], int]


def product_of(lib: ctypes.CDLL) -> Product:
    fn = lib.spindle_gemm_bf16
    fn.argtypes, fn.restype = cast(Any, gemm._ARGS), None  # (the list's type is wider than ctypes' stubs)
    return fn


def gated_of(lib: ctypes.CDLL) -> Gated:
    fn = lib.spindle_gemm_bf16_silu
    fn.argtypes, fn.restype = cast(Any, gemm._GATED_ARGS), ctypes.c_int
    return fn


PARTS = ("qkv", "o", "gate_up", "down", "lm_head")


def compare_step(libs: dict[str, ctypes.CDLL], model: str, m: int, threads: int, rounds: int) -> str:
    a = load_args(model)
    h, q, kv, inter = a.hidden_size, a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.intermediate_size
    shapes = {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * inter, h), "down": (h, inter)}
    layers = [
        {p: gemm.pack(torch.randn(n, k, dtype=torch.bfloat16)) for p, (n, k) in shapes.items()}
        for _ in range(a.num_layers)
    ]
    head = gemm.pack(torch.randn(a.vocab_size, h, dtype=torch.bfloat16))
    xs = {k: torch.randn(m, k, dtype=torch.bfloat16) for k in (h, q, inter)}
    ys = {p: torch.empty(m, n, dtype=torch.bfloat16) for p, (n, _) in shapes.items()}
    logits = torch.empty(m, a.vocab_size)
    fns = {name: (product_of(lib), gated_of(lib)) for name, lib in libs.items()}

    def step(name: str) -> list[float]:
        fn, gated = fns[name]
        spent = [0.0] * len(PARTS)
        for w in layers:
            for i, p in enumerate(PARTS[:4]):
                n, k = shapes[p]
                t = time.perf_counter()
                if p != "gate_up" or not gated(
                    xs[k].data_ptr(), k, m, k, w[p].data_ptr(), 0, n, 0, ys["gate_up"].data_ptr(), n // 2, threads
                ):
                    fn(xs[k].data_ptr(), k, m, k, w[p].data_ptr(), 0, n, 0, ys[p].data_ptr(), n, 0, 0, threads)
                spent[i] += time.perf_counter() - t
        t = time.perf_counter()
        fn(
            xs[h].data_ptr(),
            h,
            m,
            h,
            head.data_ptr(),
            0,
            a.vocab_size,
            0,
            0,
            0,
            logits.data_ptr(),
            a.vocab_size,
            threads,
        )
        spent[-1] = time.perf_counter() - t
        return [sum(spent), *spent]

    times: dict[str, list[list[float]]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name in fns:
            step(name)  # (a first pass: the other library's step has just left its weights in no cache)
            times[name].append(min((step(name) for _ in range(2)), key=lambda s: s[0]))
    lines = [f"{m} rows, {a.num_layers} layers of {model}:"]
    for name, ts in times.items():
        med = [statistics.median(t[i] for t in ts) * 1e3 for i in range(len(PARTS) + 1)]
        lines.append(
            f"  {name:>5} step {med[0]:.2f} ms (" + ", ".join(f"{p} {v:.2f}" for p, v in zip(PARTS, med[1:])) + ")"
        )
    ratio = statistics.median(t[0] / o[0] for t, o in zip(times["this"], times["other"]))
    return "\n".join(lines) + f"\n  this / other {ratio:.3f}"


def compare(fns: dict[str, Product], m: int, n: int, k: int, threads: int, rounds: int) -> str:
    copies = max(1, int(256e6 // (n * k * 2))) if m <= 32 else 1
    weights = [gemm.pack(torch.randn(n, k, dtype=torch.bfloat16)) for _ in range(copies)]
    x, y = torch.randn(m, k, dtype=torch.bfloat16), torch.empty(m, n, dtype=torch.bfloat16)

    def seconds(fn: Product) -> float:
        t = time.perf_counter()
        for w in weights:
            fn(x.data_ptr(), k, m, k, w.data_ptr(), 0, n, 0, y.data_ptr(), n, 0, 0, threads)
        return (time.perf_counter() - t) / len(weights)

    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(min(seconds(fn) for _ in range(2)))
    this, other = statistics.median(times["this"]), statistics.median(times["other"])
    ratio = statistics.median(a / b for a, b in zip(times["this"], times["other"]))
    return (
        f"{m}x{n}x{k} ({copies} copies): other {other * 1e3:.3f} ms, this {this * 1e3:.3f} ms "
        f"({2 * m * n * k / this / 1e9:.0f} GFLOP/s), this / other {ratio:.3f}"
    )


def main() -> None:
    reexec_with_huge_pages()  # as the engine process runs
    ap = argparse.ArgumentParser()
    ap.add_argument("other", help="another build of the kernel library (.so)")
    ap.add_argument(
        "--shapes",
        nargs="+",
        default=[
            "1x1152x896",
            "1x9728x896",
            "1x896x4864",
            "1x151936x896",
            "16x1152x896",
            "16x9728x896",
            "16x896x4864",
            "16x151936x896",
            "512x9728x896",
        ],
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--step", metavar="MODEL_DIR", help="a decode step's products of this checkpoint's shape")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16], help="--step: rows (sequences) per step")
    args = ap.parse_args()
    lib = build.load(build.FLAGS, build.NEEDS)
    if lib is None:
        raise SystemExit("this machine does not build the kernels")
    torch.manual_seed(0)
    if args.step:
        for m in args.rows:
            print(
                compare_step({"this": lib, "other": ctypes.CDLL(args.other)}, args.step, m, args.threads, args.rounds),
                flush=True,
            )
        return
    fns = {"this": product_of(lib), "other": product_of(ctypes.CDLL(args.other))}
    for shape in args.shapes:
        m, n, k = (int(v) for v in shape.split("x"))
        print(compare(fns, m, n, k, args.threads, args.rounds), flush=True)


if __name__ == "__main__":
    main()
