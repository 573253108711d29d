"""The roofline bound of one decode step: max(bytes read / read bandwidth, FLOPs / peak GEMM rate).

    python -m bench.roofline --model DIR [--dtype bfloat16] [--batch 1 16 64] [--context 160]
                             [--threads N] [--quantization int8] [--device cpu|cuda]

Measures this machine now (a large tensor reduction for read bandwidth, a large matmul per dtype for the
GEMM peak, at the given thread count; best of a few tries, so a loaded machine reads low: compare step
times only against rates measured in the same run) and prints, per batch, the bytes a decode step
streams (every weight once, the LM head, the KV cache at `context` tokens per sequence) and its FLOPs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.hugepages import reexec_with_huge_pages
from engine.models.args import ModelArgs
from engine.models.registry import parse_config

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class Rates:
    threads: int
    read_gbs: float  # GB/s streamed by a reduction over a tensor far larger than the caches
    peak_gflops: float  # a large GEMM in the dtype, GFLOP/s
    # the same per second of this process's CPU time, on one thread: what a core does while it runs, so
    # step CPU time against these holds still when other processes take turns on the cores
    read_gbs_cpu: float = 0.0
    peak_gflops_cpu: float = 0.0


@dataclass(frozen=True)
class StepCost:
    weight_bytes: int  # every projection, the LM head and the norms, read once per step
    kv_bytes: int  # the KV cache read by attention
    flops: int

    def bound_ms(self, rates: Rates, cpu: bool = False) -> tuple[float, str]:
        """The bound in ms and what sets it ("memory" or "compute"); cpu: in ms of one core's CPU time."""
        read, peak = (rates.read_gbs_cpu, rates.peak_gflops_cpu) if cpu else (rates.read_gbs, rates.peak_gflops)
        mem = (self.weight_bytes + self.kv_bytes) / (read * 1e9) * 1e3
        compute = self.flops / (peak * 1e9) * 1e3
        return (mem, "memory") if mem >= compute else (compute, "compute")


def _best(
    fn: Callable[[], object],
    tries: int,
    clock: Callable[[], float] = time.perf_counter,
    sync: Callable[[], None] = lambda: None,
) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(tries):
        t0 = clock()
        fn()
        sync()
        best = min(best, clock() - t0)
    return best


def measure_gpu(dtype: str, device: str = "cuda", tries: int = 10) -> Rates:
    """A GPU's read bandwidth (a 2 GiB reduction) and GEMM peak (8192^3); threads reads 0."""
    sync = torch.cuda.synchronize
    big = torch.ones(512 << 20, dtype=torch.float32, device=device)
    read = big.nbytes / _best(big.sum, tries, sync=sync) / 1e9
    del big
    n = 8192
    a = torch.randn(n, n, device=device).to(_DTYPES[dtype])
    return Rates(0, read, 2 * n**3 / _best(lambda: a @ a, tries, sync=sync) / 1e9)


def measure(dtype: str, threads: int, *, read_mib: int = 1024, gemm_n: int = 2048, tries: int = 6) -> Rates:
    """Read bandwidth and GEMM peak at `threads` intra-op threads (restored afterwards)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        big = torch.ones(read_mib << 18, dtype=torch.float32)  # read_mib MiB of float32
        read = big.nbytes / _best(big.sum, tries) / 1e9
        read_cpu = big.nbytes / _best(big.sum, tries, time.process_time) / 1e9 if threads == 1 else 0.0
        del big
        dt = _DTYPES[dtype]
        a = torch.randn(gemm_n, gemm_n).to(dt)
        gemms: list[Callable[[], object]] = [lambda: a @ a]
        if dt == torch.bfloat16:  # oneDNN with a pre-packed weight: the form engine/layers/linear.py uses
            packed = torch.ops.mkldnn._reorder_linear_weight(a)
            gemms.append(lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""))
        flop = 2 * gemm_n**3
        rate = max(flop / _best(g, max(tries // 2, 2)) for g in gemms)
        rate_cpu = max(flop / _best(g, max(tries // 2, 2), time.process_time) for g in gemms) if threads == 1 else 0.0
        return Rates(threads, read, rate / 1e9, read_cpu, rate_cpu / 1e9)
    finally:
        torch.set_num_threads(before)


def gemm_impl(dtype: str, n: int = 256) -> str:
    """oneDNN's implementation of the GEMM the engine runs in `dtype` (a pre-packed weight in bf16), as its
    verbose log names it (e.g. brg_matmul:avx10_1_512_amx: AMX tiles), or "none" (float32 goes to MKL)."""
    dt = _DTYPES[dtype]
    a = torch.randn(n, n).to(dt)
    packed = torch.ops.mkldnn._reorder_linear_weight(a) if dt == torch.bfloat16 else None
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile() as log:
        os.dup2(log.fileno(), 1)  # oneDNN writes its verbose lines from C to fd 1
        try:
            with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):  # type: ignore[no-untyped-call]
                _ = a @ a if packed is None else torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], "")
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        log.seek(0)
        lines = log.read().decode(errors="replace").splitlines()
    for line in lines:
        f = line.split(",")
        if len(f) > 6 and f[2] == "primitive" and f[5] in ("matmul", "inner_product"):
            return f[6]
    return "none"


def load_args(model: str | Path) -> ModelArgs:
    return parse_config(json.loads((Path(model) / "config.json").read_text()))


def gguf_tensor_bytes(model: str | Path) -> int | None:
    """The tensor bytes of the GGUF file a folder was derived from (its gguf.json), None for other checkpoints: a
    quantized step reads the file's blocks, not `dtype`-sized weights (a tied embedding is the head, read once)."""
    marker = Path(model) / "gguf.json"
    if not marker.is_file():
        return None
    value = json.loads(marker.read_text()).get("tensor_bytes")
    return value if isinstance(value, int) else None


def step_cost(
    args: ModelArgs,
    dtype: str,
    batch: int,
    context: int,
    quantization: str | None = None,
    weight_bytes: int | None = None,
) -> StepCost:
    """One decode step of `batch` sequences, each attending over `context` tokens; weight_bytes: what the weights
    read per step hold when known (a GGUF file's blocks), else computed from the shape and dtype."""
    item = _DTYPES[dtype].itemsize
    d, h = args.head_dim, args.hidden_size
    per_layer = (
        h * (args.num_heads + 2 * args.num_kv_heads) * d + args.num_heads * d * h + 3 * h * args.intermediate_size
    )
    proj = args.num_layers * per_layer
    head = args.vocab_size * h
    if weight_bytes is not None:
        pass
    elif quantization == "int8":  # int8 weights (the LM head's too) and one scale per output row (float32 at most)
        rows = args.num_layers * ((args.num_heads + 2 * args.num_kv_heads) * d + h + 2 * args.intermediate_size + h)
        weight_bytes = proj + head + (rows + args.vocab_size) * 4
    else:
        weight_bytes = (proj + head) * item
    norms = (2 * args.num_layers + 1) * h * item
    kv = batch * context * args.num_layers * 2 * args.num_kv_heads * d * item
    attn_flops = 4 * batch * context * args.num_heads * d * args.num_layers
    return StepCost(weight_bytes + norms, kv, 2 * batch * (proj + head) + attn_flops)


def main() -> None:
    reexec_with_huge_pages()  # as the engine process runs (engine/hugepages.py)
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="checkpoint folder (config.json is all that is read)")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPES))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--context", type=int, default=160, help="tokens each sequence attends over")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--quantization", choices=("int8",), default=None)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda: that GPU's bandwidth and GEMM peak")
    a = ap.parse_args()
    rates = measure_gpu(a.dtype, a.device) if a.device.startswith("cuda") else measure(a.dtype, a.threads)
    args = load_args(a.model)
    print(
        f"machine, {rates.threads} thread(s): read {rates.read_gbs:.1f} GB/s, {a.dtype} GEMM "
        f"{rates.peak_gflops:.0f} GFLOP/s"
    )
    if not a.device.startswith("cuda"):  # the GEMM peak per dtype, and whether oneDNN ran AMX tiles
        for dtype in ("bfloat16", "float32"):
            peak = rates.peak_gflops if dtype == a.dtype else measure(dtype, a.threads, read_mib=64).peak_gflops
            impl = gemm_impl(dtype)
            print(
                f"GEMM {dtype}: {peak:.0f} GFLOP/s, oneDNN implementation {impl}, AMX "
                f"{'used' if 'amx' in impl else 'not used'}"
            )
    print(f"{'batch':>5} {'weights MB':>10} {'KV MB':>7} {'GFLOP':>7} {'bound ms':>9}  limit")
    for b in a.batch:
        cost = step_cost(args, a.dtype, b, a.context, a.quantization)
        ms, why = cost.bound_ms(rates)
        print(
            f"{b:>5} {cost.weight_bytes / 1e6:>10.0f} {cost.kv_bytes / 1e6:>7.1f} {cost.flops / 1e9:>7.2f} "
            f"{ms:>9.2f}  {why}"
        )


if __name__ == "__main__":
    main()
