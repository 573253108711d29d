"""The gated delta rule's one-token decode update alone: engine/cpu_kernels/delta_rule.cpp against the torch form it
replaces (engine/models/recurrent/delta_decode.py torch_delta_rule_decode), ms per decode step's worth of layers.

    python -m bench.delta_rule [--batch 1 16] [--layers 18] [--heads 16] [--k-heads 16] [--dk 128] [--dv 128]
                               [--threads 1 2] [--rounds 5]

Default shape: Qwen3.5-0.8B's 18 Gated DeltaNet layers (16 value heads of 128 x 128 float32 states), bf16 rows.
Each layer has its own state pool, so the states come from memory as in a step. Both forms are checked against
each other first. Rounds alternate the two forms (this machine is shared); each figure is the best round's wall
time and the least CPU time, with the state bytes read and written per step over the best wall time.
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from collections.abc import Callable

import torch

from engine.cpu_kernels import delta_rule
from engine.models.recurrent.delta_decode import torch_delta_rule_decode

Step = Callable[[torch.Tensor], torch.Tensor]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--layers", type=int, default=18)
    ap.add_argument("--heads", type=int, default=16, help="value heads")
    ap.add_argument("--k-heads", type=int, default=16)
    ap.add_argument("--dk", type=int, default=128)
    ap.add_argument("--dv", type=int, default=128)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="the kernel's OpenMP team")
    ap.add_argument("--rounds", type=int, default=5)
    return ap.parse_args()


def timed(step: Step, pools: list[torch.Tensor]) -> tuple[float, float]:
    """(wall s, CPU s) for one call per layer's pool."""
    t0, c0 = time.perf_counter(), time.process_time()
    for states in pools:
        step(states)
    return time.perf_counter() - t0, time.process_time() - c0


def kernel_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    threads: int,
) -> torch.Tensor:
    return delta_rule.decode(q, k, v, decay, beta, states, slots, threads)


def run_batch(a: argparse.Namespace, batch: int) -> None:
    g = torch.Generator().manual_seed(batch)
    q, k = (torch.randn(batch, a.k_heads, a.dk, generator=g).bfloat16() for _ in range(2))
    v = torch.randn(batch, a.heads, a.dv, generator=g).bfloat16()
    decay, beta = -torch.rand(batch, a.heads, generator=g) * 0.01, torch.rand(batch, a.heads, generator=g).bfloat16()
    slots = torch.arange(batch) * 2 + 1  # every other slot, as a pool holding finished sequences too
    pools = [torch.randn(2 * batch + 1, a.heads, a.dk, a.dv, generator=g) for _ in range(a.layers)]
    check = pools[0].clone()
    want = torch_delta_rule_decode(q, k, v, decay, beta, check, slots)
    got = delta_rule.decode(q, k, v, decay, beta, pools[0], slots, 1)
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-4)
    torch.testing.assert_close(pools[0], check, rtol=1e-5, atol=1e-5)
    forms: dict[str, Step] = {"torch": lambda s: torch_delta_rule_decode(q, k, v, decay, beta, s, slots)}
    for n in a.threads:
        forms[f"kernel {n} thr"] = functools.partial(kernel_step, q, k, v, decay, beta, slots=slots, threads=n)
    best = {name: (float("inf"), float("inf")) for name in forms}
    for _ in range(a.rounds):
        for name, step in forms.items():
            wall, cpu = timed(step, pools)
            best[name] = (min(best[name][0], wall), min(best[name][1], cpu))
    nbytes = 2 * batch * a.heads * a.dk * a.dv * 4 * a.layers
    for name, (wall, cpu) in best.items():
        print(
            f"batch {batch:>2} {name:<13} {wall * 1e3:8.2f} ms/step (cpu {cpu * 1e3:8.2f} ms), "
            f"{nbytes / wall / 1e9:5.1f} GB/s of state read + written; load {os.getloadavg()[0]:.1f}"
        )


def main() -> None:
    a = parse_args()
    if not delta_rule.usable(torch.zeros(1, 1, a.dk), torch.zeros(1, 1, a.dk), torch.zeros(1, 1, a.dv),
                             torch.zeros(1, 1, a.dk, a.dv)):  # fmt: skip
        raise SystemExit("the delta_rule CPU kernel does not run here (engine/cpu_kernels)")
    torch.set_num_threads(1)  # the torch form as a one-thread step runs it
    for batch in a.batch:
        run_batch(a, batch)


if __name__ == "__main__":
    main()
