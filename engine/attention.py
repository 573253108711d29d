"""The model's swappable pieces: RMSNorm, rotary embedding, paged KV writes and paged attention.

`TorchOps` bundles the plain torch versions (CPU); `TritonOps` routes the same calls to `engine.kernels`
(GPU). The model only calls `ops.rms_norm / rope / write_kv / attention`, so the two swap per runner.
The KV cache of one layer is a pair of tensors [num_blocks, block_size, num_kv_heads, head_dim];
a token at position p of a sequence lives in slot block_table[p // block_size] * block_size + p % block_size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine import kernels
from engine.kernels import PagedBatch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Computed in float32 as transformers does, so half-precision runs round the same way.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim], cos_sin [T, head_dim] (rows of engine/models/rope.py's table at the positions)."""
    half = x.shape[-1] // 2
    cos, sin = cos_sin[:, None, :half], cos_sin[:, None, half:]
    if x.dtype != torch.float32:  # as transformers rounds it: cos / sin in x's dtype, each product rounded
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos + (-x2) * sin, x2 * cos + x1 * sin], dim=-1)
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    # Non-interleaved halves (rotate_half), the layout HF Llama/Qwen2/Mistral checkpoints use.
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store the step's new K/V [T, kv_heads, head_dim] in their slots."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


@dataclass
class PrefillChunk:
    """A sequence running several tokens: rows [q_start, q_start + q_len) attend over key_slots."""

    q_start: int
    q_len: int
    key_slots: torch.Tensor  # [ctx_len] slots of positions 0..ctx_len-1 (ctx_len = first position + q_len)
    mask: torch.Tensor  # [q_len, ctx_len] bool, True where attention is allowed


@dataclass
class AttnMetadata:
    """Everything attention needs for one step, built once by the runner and shared by all layers."""

    slot_mapping: torch.Tensor  # [T] where each new token's K/V goes
    decode_rows: torch.Tensor  # [B] rows of the flat batch that are single-token steps
    decode_key_slots: torch.Tensor  # [B, max_ctx] slot of each key position (padding points at slot 0)
    decode_bias: torch.Tensor  # [B, 1, 1, max_ctx] in the model's dtype: 0 where allowed, -inf elsewhere
    prefills: list[PrefillChunk] = field(default_factory=list)
    paged: PagedBatch | None = None  # the Triton path's block tables and lengths, instead of the above
    sliding_window: int | None = None  # the Triton path applies it in-kernel; the masks above already do

    @property
    def num_decodes(self) -> int:
        return int(self.decode_rows.numel())


def _gather(flat: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """flat[slots] for a slot tensor of any shape; index_select copies rows faster than indexing on CPU."""
    return flat.index_select(0, slots.flatten()).view(*slots.shape, *flat.shape[1:])


def _decode_attention(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor,
                      meta: AttnMetadata, scale: float) -> torch.Tensor:
    """q [B, heads, D] -> [B, heads, D]: every decode sequence in one padded batched SDPA call."""
    k = _gather(k_flat, meta.decode_key_slots).transpose(1, 2)  # [B, kv_heads, L, D]
    v = _gather(v_flat, meta.decode_key_slots).transpose(1, 2)
    out = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=meta.decode_bias,
                                         scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    return out[:, :, 0]


def _prefill_attention(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor,
                       chunk: PrefillChunk, scale: float) -> torch.Tensor:
    """q [Lq, heads, D] -> [Lq, heads, D] over the chunk's whole context (cached prefix + itself)."""
    k = _gather(k_flat, chunk.key_slots).transpose(0, 1).unsqueeze(0)  # [1, kv_heads, L, D]
    v = _gather(v_flat, chunk.key_slots).transpose(0, 1).unsqueeze(0)
    out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k, v, attn_mask=chunk.mask,
                                         scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    return out[0].transpose(0, 1)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttnMetadata, scale: float) -> torch.Tensor:
    """q [T, heads, D] for the flat batch -> attention output [T, heads, D]."""
    k_flat = k_cache.view(-1, *k_cache.shape[2:])
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    if not meta.prefills and meta.num_decodes == q.shape[0]:  # a pure decode step: no scatter back
        return _decode_attention(q, k_flat, v_flat, meta, scale)
    out = torch.empty_like(q)
    if meta.num_decodes:
        out[meta.decode_rows] = _decode_attention(q[meta.decode_rows], k_flat, v_flat, meta, scale)
    for chunk in meta.prefills:
        rows = slice(chunk.q_start, chunk.q_start + chunk.q_len)
        out[rows] = _prefill_attention(q[rows], k_flat, v_flat, chunk, scale)
    return out


class TorchOps:
    """The reference implementations above, behind the interface the model calls."""

    rms_norm = staticmethod(rms_norm)

    @staticmethod
    def rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
             cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = cos_sin[positions]
        return apply_rope(q, rows), apply_rope(k, rows)

    @staticmethod
    def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        write_kv(k_cache, v_cache, k, v, slot_mapping)

    attention = staticmethod(paged_attention)


class TritonOps:
    """engine.kernels' Triton kernels (CUDA, or CPU under TRITON_INTERPRET=1); metadata must carry `paged`."""

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return kernels.rms_norm(x, weight, eps)

    @staticmethod
    def rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
             cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return kernels.rotary_embedding(positions, q, k, cos_sin)  # in place

    @staticmethod
    def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        kernels.write_kv_cache(k, v, k_cache, v_cache, slot_mapping)

    @staticmethod
    def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMetadata,
                  scale: float) -> torch.Tensor:
        assert meta.paged is not None, "the runner builds `paged` metadata for the Triton path"
        fn = kernels.decode_attention if meta.paged.max_query_len == 1 else kernels.prefill_attention
        return fn(q, k_cache, v_cache, meta.paged, scale, sliding_window=meta.sliding_window)
