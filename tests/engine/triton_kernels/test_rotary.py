from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from engine.triton_kernels.rotary import rotary_embedding, rotary_embedding_ref


def cos_sin_table(max_pos: int, rotary_dim: int, theta: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / theta ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    freqs = torch.outer(torch.arange(max_pos).float(), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def test_reference_matches_transformers() -> None:
    t, heads, kv_heads, d = 6, 4, 2, 64
    table = cos_sin_table(50, d)
    pos = torch.tensor([0, 1, 7, 8, 30, 49])
    q, k = torch.randn(t, heads, d), torch.randn(t, kv_heads, d)
    half = table[pos]
    cos = torch.cat([half[:, : d // 2]] * 2, dim=-1)[None]  # HF's [batch, seq, D] duplicated halves
    sin = torch.cat([half[:, d // 2 :]] * 2, dim=-1)[None]
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    ref_q, ref_k = rotary_embedding_ref(pos, q.clone(), k.clone(), table)
    torch.testing.assert_close(ref_q, hf_q[0].transpose(0, 1))
    torch.testing.assert_close(ref_k, hf_k[0].transpose(0, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_rotary_in_place_on_qkv_views(
    dtype: torch.dtype, head_dim: int, tol: dict[torch.dtype, tuple[float, float]]
) -> None:
    t, heads, kv_heads = 9, 8, 2
    table = cos_sin_table(64, head_dim)
    pos = torch.randint(0, 64, (t,))
    # q and k as the model has them: strided views into one fused qkv projection output.
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim).to(dtype)
    expect = qkv.clone()
    q = qkv[:, : heads * head_dim].view(t, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(t, kv_heads, head_dim)
    ref_q = expect[:, : heads * head_dim].view(t, heads, head_dim)
    ref_k = expect[:, heads * head_dim : (heads + kv_heads) * head_dim].view(t, kv_heads, head_dim)
    rotary_embedding(pos, q, k, table)
    rotary_embedding_ref(pos, ref_q, ref_k, table)
    atol, rtol = tol[dtype]
    torch.testing.assert_close(qkv, expect, atol=atol, rtol=rtol)  # v untouched, q and k rotated alike


def test_partial_rotary_leaves_tail() -> None:
    t, d = 4, 64
    table = cos_sin_table(16, 32)  # rotary_dim 32 of head_dim 64
    pos = torch.tensor([1, 2, 3, 15])
    q, k = torch.randn(t, 2, d), torch.randn(t, 1, d)
    q0, k0 = q.clone(), k.clone()
    rotary_embedding(pos, q, k, table)
    ref_q, ref_k = rotary_embedding_ref(pos, q0.clone(), k0.clone(), table)
    torch.testing.assert_close(q, ref_q)
    torch.testing.assert_close(k, ref_k)
    assert torch.equal(q[..., 32:], q0[..., 32:]) and not torch.equal(q[..., :32], q0[..., :32])
