"""The bf16 GEMM kernel against another build of it, products alone, alternated in one process.

    python -m bench.gemm_ab OTHER.so [--shapes 1x9728x896 16x151936x896 ...] [--threads 2] [--rounds 15]

OTHER.so: another build of engine/cpu_kernels (e.g. an older commit's library from the spindle cache,
~/.cache/spindle/cpu_kernels/spindle-*.so, copied aside before the sources change). Each shape is MxNxK
(rows, outputs, inputs). Up to 32 rows the products rotate over enough copies of the weights (~256 MB) that
they come from memory, as in a decode step; more rows use one copy (a prefill's products are compute-bound).
Each round times both libraries (best of two passes each); printed: the medians in ms, this build's GFLOP/s,
and the median of the per-round ratios this / other (below 1: this build is faster). On a shared machine
only the ratio means much.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from collections.abc import Callable
from typing import Any, cast

import torch

from engine.cpu_kernels import build, gemm
from engine.hugepages import reexec_with_huge_pages

Product = Callable[[int, int, int, int, int, int, int, int, int, int, int, int, int], None]


def product_of(lib: ctypes.CDLL) -> Product:
    fn = lib.spindle_gemm_bf16
    fn.argtypes, fn.restype = cast(Any, gemm._ARGS), None  # (the list's type is wider than ctypes' stubs)
    return fn


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
    return (f"{m}x{n}x{k} ({copies} copies): other {other * 1e3:.3f} ms, this {this * 1e3:.3f} ms "
            f"({2 * m * n * k / this / 1e9:.0f} GFLOP/s), this / other {ratio:.3f}")


def main() -> None:
    reexec_with_huge_pages()  # as the engine process runs
    ap = argparse.ArgumentParser()
    ap.add_argument("other", help="another build of the kernel library (.so)")
    ap.add_argument("--shapes", nargs="+", default=["1x1152x896", "1x9728x896", "1x896x4864", "1x151936x896",
                                                    "16x1152x896", "16x9728x896", "16x896x4864",
                                                    "16x151936x896", "512x9728x896"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    lib = build.load(build.FLAGS, build.NEEDS)
    if lib is None:
        raise SystemExit("this machine does not build the kernels")
    torch.manual_seed(0)
    fns = {"this": product_of(lib), "other": product_of(ctypes.CDLL(args.other))}
    for shape in args.shapes:
        m, n, k = (int(v) for v in shape.split("x"))
        print(compare(fns, m, n, k, args.threads, args.rounds), flush=True)


if __name__ == "__main__":
    main()
