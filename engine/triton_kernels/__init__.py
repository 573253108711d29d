"""Triton kernels for the CUDA path, each beside the torch reference it is tested against.

Call the functions here: they run the Triton kernel where use_triton(device) says so and the torch
reference otherwise. Kernel modules are imported on first use, because @triton.jit reads
TRITON_INTERPRET at import time (tests set it to run the kernels on CPU tensors).

One decoder layer on CUDA (T flat tokens, each sequence's rows contiguous, in batch order):
    batch = build_paged_batch(block_tables, seq_lens=[start + n], query_lens=[n], block_size, device)  # per step
    h, x = fused_add_rms_norm(prev_out, x, ln1, eps)        # layer 0: h = rms_norm(x, ln1, eps)
    q, k, v = qkv.split(...); q = q.view(T, H, D); k = k.view(T, KH, D); v = v.view(T, KH, D)
    rotary_embedding(positions, q, k, cos_sin)              # in place; cos_sin = engine/models/rope.py's rope_table,
                                                            # int64 positions
    write_kv_cache(k, v, k_cache, v_cache, slot_mapping)    # caches [num_blocks, block_size, KH, D]
    attn = (decode_attention if batch.max_query_len == 1 else prefill_attention)(q, k_cache, v_cache, batch, scale)
"""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType
from typing import Any

import torch

from engine.triton_kernels.metadata import PagedBatch, build_paged_batch

__all__ = ["PagedBatch", "apply_token_bitmask", "build_paged_batch", "decode_attention", "fused_add_rms_norm",
           "lora_expand", "lora_shrink", "prefill_attention",
           "rms_norm", "rotary_embedding", "triton_available", "use_triton", "write_kv_cache"]
# No function here may share a kernel module's name: importing engine.triton_kernels.X rebinds engine.triton_kernels.X.


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401  # why late: the probe for an optional dependency
    except ImportError:
        return False
    return True


def use_triton(device: torch.device | str) -> bool:
    """True on CUDA when triton imports; on CPU only under TRITON_INTERPRET=1 (slow; for tests).

    The model runner makes its own choice of path (TritonOps on CUDA); these functions then follow the
    tensors' device, so the kernel tests' process-wide TRITON_INTERPRET does not move the CPU model."""
    kind = torch.device(device).type
    if kind == "cuda":
        return triton_available()
    return kind == "cpu" and os.environ.get("TRITON_INTERPRET") == "1" and triton_available()


def _module(name: str) -> ModuleType:
    return importlib.import_module(f"engine.triton_kernels.{name}")


def _pick(module: str, fn: str, device: torch.device) -> Any:
    return getattr(_module(module), fn if use_triton(device) else f"{fn}_ref")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _pick("rmsnorm", "rms_norm", x.device)(x, weight, eps)  # type: ignore[no-any-return]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _pick("rmsnorm", "fused_add_rms_norm", x.device)(x, residual, weight, eps)  # type: ignore[no-any-return]


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _pick("rotary", "rotary_embedding", q.device)(positions, q, k, cos_sin_cache)  # type: ignore[no-any-return]


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    _pick("kv_cache_write", "write_kv_cache", k.device)(k, v, k_cache, v_cache, slot_mapping)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: PagedBatch,
                     scale: float, *, sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """q [B, heads, D], one token per sequence of batch -> [B, heads, D]; softcap: scores -> c * tanh(s / c)."""
    mod = _module("paged_decode_attention")
    args = (q, k_cache, v_cache, batch.block_tables, batch.seq_lens, scale)
    if use_triton(q.device):
        return mod.paged_decode_attention(*args, sliding_window=sliding_window,  # type: ignore[no-any-return]
                                          softcap=softcap, max_seq_len=batch.max_seq_len)
    return mod.paged_decode_attention_ref(*args, sliding_window=sliding_window,  # type: ignore[no-any-return]
                                          softcap=softcap)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: PagedBatch,
                      scale: float, *, sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """q [T, heads, D], the batch's query chunks back to back (any lengths, 1 included) -> [T, heads, D]."""
    mod = _module("paged_prefill_attention")
    args = (q, k_cache, v_cache, batch.block_tables, batch.cu_seqlens_q, batch.seq_lens, scale)
    if use_triton(q.device):
        return mod.paged_prefill_attention(*args, sliding_window=sliding_window,  # type: ignore[no-any-return]
                                           softcap=softcap, max_query_len=batch.max_query_len)
    return mod.paged_prefill_attention_ref(*args, sliding_window=sliding_window,  # type: ignore[no-any-return]
                                           softcap=softcap)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place: logits[rows[i], t] = -inf where bit t of bitmask[i] is 0 (bitmask [M, ceil(V / 32)] int32)."""
    _pick("token_bitmask", "apply_token_bitmask", logits.device)(logits, bitmask, rows)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, rows: torch.Tensor, tiles: torch.Tensor, rank: int) -> torch.Tensor:
    """h [N, rank] float32 = x[rows] @ A[slot].T per tile of engine/lora/mapping.py (engine/triton_kernels/lora.py)."""
    return _pick("lora", "lora_shrink", x.device)(x, a, rows, tiles, rank)  # type: ignore[no-any-return]


def lora_expand(h: torch.Tensor, b: torch.Tensor, scaling: torch.Tensor, y: torch.Tensor, rows: torch.Tensor,
                tiles: torch.Tensor) -> None:
    """In place: y[rows] += (h @ B[slot].T) * scaling[slot] per tile (engine/triton_kernels/lora.py)."""
    _pick("lora", "lora_expand", h.device)(h, b, scaling, y, rows, tiles)
