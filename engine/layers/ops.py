"""The model's swappable pieces: RMSNorm, rotary embedding, paged KV writes and paged attention.

`TorchOps` bundles the plain torch versions (CPU; attention in engine/layers/cpu_attention.py); `TritonOps` routes
the same calls to `engine.triton_kernels` (GPU). The model only calls `ops.rms_norm / rope / write_kv / attention`,
so the two swap per runner. The KV cache of one layer is a pair of tensors [num_blocks, block_size,
num_kv_heads, head_dim] (on CPU a view of head-major storage); a token at position p of a sequence lives in
slot block_table[p // block_size] * block_size + p % block_size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine import triton_kernels
from engine.cpu_kernels import layer_ops
from engine.layers.cpu_attention import DecodeSeqs, PrefillChunk, decode_attention, prefill_attention
from engine.layers.parallel import WORKERS
from engine.triton_kernels import PagedBatch


def _cpu_kernel(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether engine/cpu_kernels/layer_ops.py takes this bf16 CPU norm (it rounds as the torch code here)."""
    return weight.dtype == torch.bfloat16 and layer_ops.usable(x)


def _threads(x: torch.Tensor) -> int:
    return WORKERS.threads_for(0, 4 * x.numel())  # read and written once: a prefill's rows, not a decode's


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x normed in float32, rounded to x's dtype), as transformers rounds it. torch's fused kernel
    gives bitwise the float32 `x * rsqrt(mean(x^2) + eps)` rounded once (tests/engine/test_model.py), in one op
    instead of six."""
    if _cpu_kernel(x, weight):
        return layer_ops.add_rms_norm(x, None, weight, eps, _threads(x))[1]
    return weight * torch.rms_norm(x, (x.shape[-1],), eps=eps)


def add_rms_norm(
    x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + h, rms_norm(x + h)): a residual add and the next norm, in one pass where the CPU kernel runs."""
    if h.dtype == x.dtype and _cpu_kernel(x, weight):
        return layer_ops.add_rms_norm(x, h, weight, eps, _threads(x))
    s = x + h
    return s, rms_norm(s, weight, eps)


def rope_halves(cos_sin: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [T, head_dim / 2] in `dtype` from table rows cos_sin [T, head_dim] (cos | sin). Half precision
    takes them in its own dtype, as transformers does, so each product is rounded as there."""
    half = cos_sin.shape[-1] // 2
    return cos_sin[:, :half].to(dtype).contiguous(), cos_sin[:, half:].to(dtype).contiguous()


def rope_factors(cos_sin: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [T, 1, head_dim] in `dtype`, each half repeated (rope_halves'), from table rows cos_sin
    [T, head_dim]; made once per step and shared by every layer's `rotate`."""
    cos, sin = rope_halves(cos_sin, dtype)
    return torch.cat([cos, cos], dim=-1)[:, None], torch.cat([sin, sin], dim=-1)[:, None]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] turned by rope_factors' (cos, sin): x * cos + rotate_half(x) * sin, the
    non-interleaved halves HF Llama/Qwen2/Mistral checkpoints use."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def apply_rope(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim], cos_sin [T, head_dim] (rows of engine/models/rope.py's table at the positions)."""
    return rotate(x, *rope_factors(cos_sin, x.dtype))


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store the step's new K/V [T, kv_heads, head_dim] in their slots."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


@dataclass
class AttnMetadata:
    """Everything attention needs for one step, built once by the runner and shared by all layers.

    Windows and soft-capping are arguments of each attention call, not part of the metadata, so layers
    with different windows (Gemma's local and global layers) share it."""

    slot_mapping: torch.Tensor  # [T] where each new token's K/V goes
    decodes: DecodeSeqs | None = None  # the CPU path's single-token sequences
    prefills: list[PrefillChunk] = field(default_factory=list)  # the CPU path's multi-token chunks
    paged: PagedBatch | None = None  # the Triton path's block tables and lengths, instead of the above


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttnMetadata,
    scale: float,
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q [T, heads, D] for the flat batch -> attention output [T, heads, D] (engine/layers/cpu_attention.py).

    window: a query at position p sees keys (p - window, p]; softcap: scores become softcap * tanh(s / softcap)."""
    decodes = meta.decodes
    if decodes is not None and not meta.prefills and len(decodes) == q.shape[0]:  # pure decode: no scatter
        return decode_attention(q, k_cache, v_cache, decodes, scale, window, softcap)
    out = torch.empty_like(q)
    if decodes is not None and len(decodes):
        rows = decodes.rows
        out.index_copy_(
            0, rows, decode_attention(q.index_select(0, rows), k_cache, v_cache, decodes, scale, window, softcap)
        )
    for chunk in meta.prefills:
        rows_ = slice(chunk.q_start, chunk.q_start + chunk.q_len)
        out[rows_] = prefill_attention(q[rows_], k_cache, v_cache, chunk, scale, window, softcap)
    return out


class TorchOps:
    """The reference implementations above, behind the interface the model calls."""

    rms_norm = staticmethod(rms_norm)
    add_rms_norm = staticmethod(add_rms_norm)

    @staticmethod
    def rope(
        positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows = cos_sin[positions]
        return apply_rope(q, rows), apply_rope(k, rows)

    @staticmethod
    def write_kv(
        k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        write_kv(k_cache, v_cache, k, v, slot_mapping)

    attention = staticmethod(paged_attention)


class TritonOps:
    """engine.triton_kernels' Triton kernels (CUDA, or CPU under TRITON_INTERPRET=1); metadata must carry `paged`."""

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return triton_kernels.rms_norm(x, weight, eps)

    @staticmethod
    def add_rms_norm(
        x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        s = x + h
        return s, triton_kernels.rms_norm(s, weight, eps)

    @staticmethod
    def rope(
        positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return triton_kernels.rotary_embedding(positions, q, k, cos_sin)  # in place

    @staticmethod
    def write_kv(
        k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        triton_kernels.write_kv_cache(k, v, k_cache, v_cache, slot_mapping)

    @staticmethod
    def attention(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttnMetadata,
        scale: float,
        *,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        assert meta.paged is not None, "the runner builds `paged` metadata for the Triton path"
        fn = triton_kernels.decode_attention if meta.paged.max_query_len == 1 else triton_kernels.prefill_attention
        return fn(q, k_cache, v_cache, meta.paged, scale, sliding_window=window, softcap=softcap)
