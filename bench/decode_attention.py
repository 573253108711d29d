"""Decode attention on CPU: ms per layer call of the engine's path against the alternatives it replaced.

    python -m bench.decode_attention [--batch 1 16 64] [--ctx 128 512 2048] [--dtype bfloat16 float32]
                                     [--mixed] [--threads 1] [--rounds 3] [--tile-bytes N]
                                     [--heads 14] [--kv-heads 2] [--cold 24]
    python -m bench.decode_attention --model DIR [--batch 16] [--dtype bfloat16] [--steps 8]

Shape: Qwen2.5-0.5B's attention (14 query heads over 2 KV heads, head_dim 64; the tiny demo: --heads 2
--kv-heads 2), block_size 16, blocks
shuffled. One query token per sequence, every sequence at --ctx tokens (--mixed: uniform in [1, ctx],
one at ctx). Variants, each checked against a float32 reference before it is timed:
  sdpa     the previous path: every context gathered slot by slot, padded to the longest, one SDPA call
           with an additive mask (torch picks its tiled flash kernel, even for one query token)
  padded   one gather of whole blocks padded to the longest, a batched matmul per KV head, length mask
  per_seq  a loop over sequences: k_cache[blocks] of that sequence, two bmm over the KV heads
  engine   engine/layers/cpu_attention.py: the bf16 kernel (engine/cpu_kernels/decode_attention.cpp) where it runs,
           else head-major cache, tiles of blocks, rows dropping out as they end
Rounds interleave the variants (this machine is shared); each figure is the best round. The step runs
on one intra-op thread in the engine (engine/execution/model_runner.py one_intra_op_thread), hence --threads 1;
--threads also gives the kernel its threads, as the step's workers do. --cold N: the engine's calls rotate
over N copies of the caches, so that (as in a step's layers) they come from memory, not from cache.
With --model: decode steps of that checkpoint through EngineCore (128-token prompts, as bench.profile_step),
printing ms per step and the ms of it spent in the model's attention calls.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench.profile_step import add_batch
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.hugepages import reexec_with_huge_pages
from engine.layers import cpu_attention
from engine.layers.cpu_attention import DecodeSeqs, decode_attention
from engine.layers.ops import TorchOps
from engine.layers.parallel import WORKERS
from engine.messages import SamplingParams
from engine.triton_kernels.paged_common import attend_ref

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 14, 2, 64, 16
COPIES = 1  # --cold: the engine's calls rotate over this many copies of the caches, as a step's layers do
SCALE = HEAD_DIM**-0.5
Variant = Callable[[], torch.Tensor]


class Case:
    def __init__(self, lens: list[int], dtype: torch.dtype) -> None:
        need = [-(-n // BLOCK) for n in lens]
        num_blocks = sum(need) + 1
        order = list(range(num_blocks))
        random.Random(0).shuffle(order)
        self.tables = [[order.pop() for _ in range(n)] for n in need]
        self.lens = lens
        # the engine's CPU storage is head-major; the other variants read the [block, slot, head] layout
        store_k = torch.randn(KV_HEADS, num_blocks, BLOCK, HEAD_DIM).to(dtype)
        store_v = torch.randn(KV_HEADS, num_blocks, BLOCK, HEAD_DIM).to(dtype)
        self.k_hm, self.v_hm = store_k.permute(1, 2, 0, 3), store_v.permute(1, 2, 0, 3)
        self.k, self.v = self.k_hm.contiguous(), self.v_hm.contiguous()
        self.q = torch.randn(len(lens), HEADS, HEAD_DIM).to(dtype)

    def padded_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(t) for t in self.tables)
        table = torch.tensor([t + [0] * (width - len(t)) for t in self.tables])
        visible = torch.arange(width * BLOCK)[None, :] < torch.tensor(self.lens)[:, None]
        return table, visible


def sdpa(c: Case) -> Variant:
    table, visible = c.padded_tables()
    longest = max(c.lens)
    slots = (table[:, :, None] * BLOCK + torch.arange(BLOCK)).flatten(1)[:, :longest]
    bias = torch.zeros(visible.shape, dtype=c.q.dtype).masked_fill_(~visible, float("-inf"))[:, None, None, :longest]
    k_flat, v_flat = c.k.flatten(0, 1), c.v.flatten(0, 1)

    def run() -> torch.Tensor:
        k = k_flat.index_select(0, slots.flatten()).view(*slots.shape, KV_HEADS, HEAD_DIM).transpose(1, 2)
        v = v_flat.index_select(0, slots.flatten()).view(*slots.shape, KV_HEADS, HEAD_DIM).transpose(1, 2)
        return F.scaled_dot_product_attention(c.q[:, :, None], k, v, attn_mask=bias, scale=SCALE, enable_gqa=True)[
            :, :, 0
        ]

    return run


def padded(c: Case) -> Variant:
    table, visible = c.padded_tables()
    bias = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))[:, None, :]
    b, width = table.shape
    group = HEADS // KV_HEADS

    def run() -> torch.Tensor:
        k = c.k.index_select(0, table.flatten()).view(b, width * BLOCK, KV_HEADS, HEAD_DIM)
        v = c.v.index_select(0, table.flatten()).view(b, width * BLOCK, KV_HEADS, HEAD_DIM)
        q = c.q.view(b, KV_HEADS, group, HEAD_DIM)
        out = torch.empty(b, KV_HEADS, group, HEAD_DIM, dtype=c.q.dtype)
        for h in range(KV_HEADS):
            s = torch.bmm(q[:, h], k[:, :, h].transpose(1, 2)).float().mul_(SCALE).add_(bias)
            out[:, h] = torch.bmm(torch.softmax(s, dim=-1).to(v.dtype), v[:, :, h])
        return out.view(b, HEADS, HEAD_DIM)

    return run


def per_seq(c: Case) -> Variant:
    tables = [torch.tensor(t) for t in c.tables]
    group = HEADS // KV_HEADS

    def run() -> torch.Tensor:
        out = torch.empty_like(c.q)
        for i, n in enumerate(c.lens):
            k = c.k.index_select(0, tables[i]).flatten(0, 1)[:n]  # [n, kv_heads, D]
            v = c.v.index_select(0, tables[i]).flatten(0, 1)[:n]
            s = torch.bmm(c.q[i].view(KV_HEADS, group, HEAD_DIM), k.permute(1, 2, 0)).float().mul_(SCALE)
            p = torch.softmax(s, dim=-1).to(v.dtype)
            out[i] = torch.bmm(p, v.transpose(0, 1)).view(HEADS, HEAD_DIM)
        return out

    return run


def engine(c: Case) -> Variant:
    rows = torch.arange(len(c.lens))

    caches = [(c.k_hm, c.v_hm)] + [(c.k_hm.clone(), c.v_hm.clone()) for _ in range(COPIES - 1)]
    turn = [0]

    def run() -> torch.Tensor:  # the metadata is per step, shared by the layers: built outside the timing
        k, v = caches[turn[0] % len(caches)]
        turn[0] += 1
        return decode_attention(c.q, k, v, seqs, SCALE)

    seqs = DecodeSeqs(rows, c.lens, c.tables, BLOCK)
    seqs.view(None)
    return run


VARIANTS = {"sdpa": sdpa, "padded": padded, "per_seq": per_seq, "engine": engine}


def reference(c: Case) -> torch.Tensor:
    out = torch.empty(c.q.shape)
    for i, n in enumerate(c.lens):
        slots = [c.tables[i][p // BLOCK] * BLOCK + p % BLOCK for p in range(n)]
        out[i] = attend_ref(
            c.q[i : i + 1], c.k.flatten(0, 1)[slots], c.v.flatten(0, 1)[slots], torch.tensor([n - 1]), SCALE, None
        )[0]
    return out


def measure(fns: dict[str, Variant], rounds: int, budget_s: float = 0.05) -> dict[str, float]:
    """Best ms per call over interleaved rounds; reps per round sized from one untimed call."""
    reps = {}
    for name, fn in fns.items():
        t0 = time.perf_counter()
        fn()
        reps[name] = max(1, int(budget_s / max(time.perf_counter() - t0, 1e-6)))
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(reps[name]):
                fn()
            best[name] = min(best[name], (time.perf_counter() - t0) / reps[name] * 1e3)
    return best


def in_steps(model: str, batch: int, dtype: str, steps: int) -> None:
    """ms per decode step of a real checkpoint, and how much of it is inside ops.attention."""
    core = EngineCore(
        EngineConfig(
            model=model, dtype=dtype, max_num_seqs=256, max_num_batched_tokens=8192, enable_prefix_caching=False
        )
    )
    add_batch(core, batch, 128, SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True))
    for _ in range(3):  # the prefill, then warm-up decodes
        core.step()
    spent = [0.0]
    attention = TorchOps.attention

    def timed(*args: object, **kwargs: object) -> torch.Tensor:
        t0 = time.perf_counter()
        try:
            return attention(*args, **kwargs)  # type: ignore[arg-type]
        finally:
            spent[0] += time.perf_counter() - t0

    core.runner.model.ops = type("TimedOps", (TorchOps,), {"attention": staticmethod(timed)})
    t0 = time.perf_counter()
    for _ in range(steps):
        core.step()
    step_ms, attn_ms = (time.perf_counter() - t0) / steps * 1e3, spent[0] / steps * 1e3
    print(f"batch {batch} {dtype}: step {step_ms:.1f} ms, attention {attn_ms:.1f} ms ({attn_ms / step_ms:.0%})")


def main() -> None:
    reexec_with_huge_pages()  # as the engine process runs (engine/hugepages.py)
    global HEADS, KV_HEADS  # the variants read the shape from the module
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--ctx", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--mixed", action="store_true", help="context lengths uniform in [1, ctx]")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--cold",
        type=int,
        default=1,
        metavar="N",
        help="the engine's calls rotate over N copies of the caches (24: a step's layers, out of cache)",
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--heads", type=int, default=HEADS)
    ap.add_argument("--kv-heads", type=int, default=KV_HEADS)
    ap.add_argument("--tile-bytes", type=int, default=cpu_attention.TILE_BYTES, help="the engine's decode tile size")
    ap.add_argument("--model", help="time decode steps of this checkpoint instead (first --batch, first --dtype)")
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    if args.model:
        torch.set_num_threads(2)  # the engine's LM head uses torch's thread count; the step runs on one
        return in_steps(args.model, args.batch[0], args.dtype[0], args.steps)
    cpu_attention.TILE_BYTES = args.tile_bytes
    HEADS, KV_HEADS = args.heads, args.kv_heads
    global COPIES
    COPIES = args.cold
    torch.set_num_threads(args.threads)
    WORKERS.configure(args.threads)  # the engine's kernel takes its threads from the step's workers
    torch.manual_seed(0)
    print(
        f"ms per layer call (heads {HEADS}/{KV_HEADS}, head_dim {HEAD_DIM}, block {BLOCK}, "
        f"threads {args.threads}, tile {args.tile_bytes >> 10} KiB{', mixed lengths' if args.mixed else ''}); "
        "x: time / engine's"
    )
    print(f"{'dtype':9} {'batch':>5} {'ctx':>5} " + " ".join(f"{n:>16}" for n in VARIANTS))
    for dtype_name in args.dtype:
        dtype = getattr(torch, dtype_name)
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        for batch in args.batch:
            for ctx in args.ctx:
                rng = random.Random(batch * ctx)
                lens = [ctx] + [rng.randint(1, ctx) if args.mixed else ctx for _ in range(batch - 1)]
                case = Case(lens, dtype)
                fns = {name: make(case) for name, make in VARIANTS.items()}
                ref = reference(case)
                for name, fn in fns.items():
                    err = float((fn().float() - ref).abs().max())
                    assert err < tol, f"{name} is off by {err:.1e} at batch {batch}, ctx {ctx}, {dtype_name}"
                ms = measure(fns, args.rounds)
                cells = " ".join(f"{ms[n]:8.3f} ({ms[n] / ms['engine']:4.1f}x)" for n in VARIANTS)
                print(f"{dtype_name:9} {batch:5} {ctx:5} {cells}", flush=True)


if __name__ == "__main__":
    main()
