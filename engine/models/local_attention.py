"""Per-layer sliding windows and logit soft-capping over the paged cache, until the attention ops take them.

Interim: `ops.attention(..., window=, softcap=)` (engine/attention.py, the attention work of issue 26) replaces
this module. Until then a layer whose window differs from the metadata's masks, or that soft-caps, runs this
torch reference: the metadata's causal masks narrowed to the window, scores capped before the softmax.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention import AttnMetadata, TorchOps, TritonOps


def attend(ops: type[TorchOps] | type[TritonOps], q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           meta: AttnMetadata, scale: float, *, window: int | None, softcap: float | None) -> torch.Tensor:
    """q [T, heads, D] -> [T, heads, D]: ops.attention, with `window` and `softcap` applied here."""
    if window is None and softcap is None:
        return ops.attention(q, k_cache, v_cache, meta, scale)
    if meta.paged is not None:
        raise NotImplementedError("per-layer sliding windows and soft-capping on the Triton path need the "
                                  "attention kernels' window/softcap arguments")
    k_flat, v_flat = k_cache.view(-1, *k_cache.shape[2:]), v_cache.view(-1, *v_cache.shape[2:])
    out = torch.empty_like(q)
    if meta.num_decodes:
        allowed = meta.decode_bias[:, 0, 0, :] == 0  # [B, L]: causal (padding excluded)
        q_pos = allowed.sum(-1, keepdim=True) - 1
        rows = meta.decode_rows
        out[rows] = _attend(q[rows][:, None], k_flat[meta.decode_key_slots], v_flat[meta.decode_key_slots],
                            _narrow(allowed[:, None, :], q_pos[:, :, None], window), scale, softcap)[:, 0]
    for chunk in meta.prefills:
        ctx = chunk.key_slots.numel()
        q_pos = torch.arange(ctx - chunk.q_len, ctx, device=q.device)[:, None]
        rows_slice = slice(chunk.q_start, chunk.q_start + chunk.q_len)
        mask = _narrow(chunk.mask, q_pos, window)
        out[rows_slice] = _attend(q[rows_slice][None], k_flat[chunk.key_slots][None], v_flat[chunk.key_slots][None],
                                  mask[None], scale, softcap)[0]
    return out


def _narrow(allowed: torch.Tensor, q_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """allowed [..., Lq, L] and q_pos broadcastable to [..., Lq, 1] -> also within `window` of the query."""
    if window is None:
        return allowed
    k_pos = torch.arange(allowed.shape[-1], device=allowed.device)
    return allowed & (q_pos - k_pos < window)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float,
            softcap: float | None) -> torch.Tensor:
    """q [B, Lq, H, D], k / v [B, L, KH, D], allowed [B, Lq, L] -> [B, Lq, H, D], as transformers computes it:
    SDPA without a cap; with one, its eager path (scores in the model dtype, capped, masked, softmax in float32)."""
    b, lq, h, d = q.shape
    kh = k.shape[2]
    if softcap is None:
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=allowed[:, None], scale=scale, enable_gqa=kh != h)
        return out.transpose(1, 2)
    qg = q.view(b, lq, kh, h // kh, d).permute(0, 2, 3, 1, 4)  # [B, KH, G, Lq, D]
    scores = torch.matmul(qg, k.permute(0, 2, 3, 1)[:, :, None]) * scale  # [B, KH, G, Lq, L]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, v.permute(0, 2, 1, 3)[:, :, None])  # [B, KH, G, Lq, D]
    return out.permute(0, 3, 1, 2, 4).reshape(b, lq, h, d)
