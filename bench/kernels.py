"""Triton kernels against their torch equivalents at serving shapes (needs CUDA).

    python -m bench.kernels [--batch 64] [--ctx 1024] [--heads 32] [--kv-heads 8] [--head-dim 128]

Prints one row per kernel: torch and Triton time (median, CUDA-synchronised), speed-up, and the
largest difference from torch, so a fast but wrong kernel shows. TRITON_INTERPRET=1 with tiny shapes
runs it on CPU as a smoke test of the script (times there mean nothing).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F


def timed(fn: Callable[[], object]) -> float:
    """Median microseconds per call (one untimed-warmup call on CPU, where this is only a smoke run)."""
    if not torch.cuda.is_available():
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median")) * 1e3


def decode_torch(
    q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, slots: torch.Tensor, scale: float
) -> torch.Tensor:
    """Gather every sequence's context (all one length here) and run SDPA: the batched torch path."""
    k = k_flat[slots].transpose(1, 2)  # [B, kv_heads, ctx, D]
    v = v_flat[slots].transpose(1, 2)
    return F.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale, enable_gqa=True)[:, :, 0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--prefill-seqs", type=int, default=4)
    p.add_argument("--prefill-len", type=int, default=512)
    args = p.parse_args()
    if torch.cuda.is_available():
        dev = torch.device("cuda")
    elif os.environ.get("TRITON_INTERPRET") == "1":  # smoke run of this script on CPU; pass tiny shapes
        dev = torch.device("cpu")
    else:
        print("bench.kernels needs a CUDA GPU (the Triton kernels run only there); nothing to measure here.")
        sys.exit(0)

    from engine.triton_kernels import kv_cache_write, rmsnorm, rotary
    from engine.triton_kernels import paged_decode_attention as decode_mod
    from engine.triton_kernels import paged_prefill_attention as prefill_mod

    torch.manual_seed(0)
    dt = torch.bfloat16
    b, ctx, h, kvh, d, bs = args.batch, args.ctx, args.heads, args.kv_heads, args.head_dim, args.block_size
    hidden, scale = h * d, d**-0.5
    rows: list[tuple[str, float, float, float]] = []

    def row(
        name: str,
        ref: Callable[[], torch.Tensor],
        tri: Callable[[], torch.Tensor],
        fresh: Callable[[], None] | None = None,
    ) -> None:
        """fresh() restores the inputs an in-place kernel changed, so both sides see the same values."""
        if fresh:
            fresh()
        expect = ref().float()
        if fresh:
            fresh()
        diff = (expect - tri().float()).abs().max().item()
        rows.append((name, timed(ref), timed(tri), diff))

    # RMSNorm over one decode step's hidden states, plain and fused with the residual add.
    x, res = torch.randn(b, hidden, device=dev, dtype=dt), torch.randn(b, hidden, device=dev, dtype=dt)
    w = torch.randn(hidden, device=dev, dtype=dt)
    row(f"rms_norm [{b},{hidden}]", lambda: rmsnorm.rms_norm_ref(x, w, 1e-6), lambda: rmsnorm.rms_norm(x, w, 1e-6))
    row(
        f"fused_add_rms_norm [{b},{hidden}]",
        lambda: rmsnorm.fused_add_rms_norm_ref(x, res, w, 1e-6)[0],
        lambda: rmsnorm.fused_add_rms_norm(x, res, w, 1e-6)[0],
    )

    # Rotary on q/k views of a fused qkv output, as many tokens as the prefill below.
    ps, pl = min(args.prefill_seqs, b), min(args.prefill_len, args.ctx)
    t = ps * pl
    qkv = torch.randn(t, (h + 2 * kvh) * d, device=dev, dtype=dt)
    q_view = qkv[:, : h * d].view(t, h, d)
    k_view = qkv[:, h * d : (h + kvh) * d].view(t, kvh, d)
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2, device=dev).float() / d)
    freqs = torch.outer(torch.arange(4096, device=dev).float(), inv)
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    pos = torch.randint(0, 4096, (t,), device=dev)
    qkv0 = qkv.clone()

    def restore_qkv() -> None:
        qkv.copy_(qkv0)

    row(
        f"rotary [{t},{h}+{kvh},{d}]",
        lambda: rotary.rotary_embedding_ref(pos, q_view, k_view, cos_sin)[0],
        lambda: rotary.rotary_embedding(pos, q_view, k_view, cos_sin)[0],
        fresh=restore_qkv,
    )

    # Paged cache: batch sequences of ctx tokens, blocks shuffled.
    n_blocks = b * ctx // bs
    k_cache = torch.randn(n_blocks, bs, kvh, d, device=dev, dtype=dt)
    v_cache = torch.randn(n_blocks, bs, kvh, d, device=dev, dtype=dt)
    tables = torch.randperm(n_blocks, device=dev).view(b, ctx // bs).int()
    seq_lens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
    k_flat, v_flat = k_cache.view(-1, kvh, d), v_cache.view(-1, kvh, d)
    offs = torch.arange(bs, device=dev)
    slots = (tables.long()[:, :, None] * bs + offs).flatten(1)  # [B, ctx]

    kn, vn = torch.randn(b, kvh, d, device=dev, dtype=dt), torch.randn(b, kvh, d, device=dev, dtype=dt)
    step_slots = slots[:, -1].contiguous()
    row(
        f"write_kv_cache [{b},{kvh},{d}]",
        lambda: (kv_cache_write.write_kv_cache_ref(kn, vn, k_cache, v_cache, step_slots), k_cache)[1],
        lambda: (kv_cache_write.write_kv_cache(kn, vn, k_cache, v_cache, step_slots), k_cache)[1],
    )

    qd = torch.randn(b, h, d, device=dev, dtype=dt)
    row(
        f"decode attn B{b} ctx{ctx} {h}/{kvh}x{d}",
        lambda: decode_torch(qd, k_flat, v_flat, slots, scale),
        lambda: decode_mod.paged_decode_attention(qd, k_cache, v_cache, tables, seq_lens, scale, max_seq_len=ctx),
    )
    for splits in (1, 4):
        row(
            f"decode attn B{b} ctx{ctx}, {splits} splits",
            lambda: decode_torch(qd, k_flat, v_flat, slots, scale),
            lambda splits=splits: decode_mod.paged_decode_attention(
                qd, k_cache, v_cache, tables, seq_lens, scale, num_splits=splits
            ),
        )
    q1 = qd[:1]
    row(
        f"decode attn B1 ctx{ctx} (split-K)",
        lambda: decode_torch(q1, k_flat, v_flat, slots[:1], scale),
        lambda: decode_mod.paged_decode_attention(
            q1, k_cache, v_cache, tables[:1], seq_lens[:1], scale, max_seq_len=ctx
        ),
    )

    # Extend: prefill_seqs chunks of prefill_len new tokens after a cached prefix of ctx - prefill_len.
    qp = torch.randn(ps * pl, h, d, device=dev, dtype=dt)
    cu = torch.arange(0, ps + 1, device=dev, dtype=torch.int32) * pl
    mask = torch.arange(ctx, device=dev)[None, :] <= torch.arange(ctx - pl, ctx, device=dev)[:, None]

    def prefill_torch() -> torch.Tensor:
        outs = []
        for i in range(ps):
            k, v = k_flat[slots[i]].transpose(0, 1), v_flat[slots[i]].transpose(0, 1)
            qi = qp[i * pl : (i + 1) * pl].transpose(0, 1)
            outs.append(
                F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale, enable_gqa=True).transpose(0, 1)
            )
        return torch.cat(outs)

    row(
        f"prefill attn {ps}x{pl} new, ctx{ctx}",
        prefill_torch,
        lambda: prefill_mod.paged_prefill_attention(
            qp, k_cache, v_cache, tables[:ps], cu, seq_lens[:ps], scale, max_query_len=pl
        ),
    )

    kv_bytes = 2 * b * ctx * kvh * d * dt.itemsize
    where = torch.cuda.get_device_name() if dev.type == "cuda" else "CPU (Triton interpreter; times meaningless)"
    print(f"{where}  bf16  block_size {bs}")
    print(f"{'kernel':44} {'torch us':>10} {'triton us':>10} {'speedup':>8} {'max diff':>9}")
    for name, ref_us, tri_us, diff in rows:
        print(f"{name:44} {ref_us:10.1f} {tri_us:10.1f} {ref_us / tri_us:8.2f} {diff:9.2e}")
    decode_us = next(r[2] for r in rows if r[0].startswith("decode attn B"))
    print(f"decode attention reads {kv_bytes / 2**20:.0f} MiB of K/V: {kv_bytes / decode_us / 1e3:.0f} GB/s")


if __name__ == "__main__":
    main()
