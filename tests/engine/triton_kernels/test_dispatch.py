"""The dispatch API the model calls: it picks the kernels under the interpreter, and its tensors match
the layout engine/layers/ops.py (the model's torch path) uses."""

from __future__ import annotations

import pytest
import torch

import engine.triton_kernels as K
from engine.layers.ops import apply_rope, rms_norm, write_kv
from engine.triton_kernels.paged_prefill_attention import paged_prefill_attention_ref
from tests.engine.triton_kernels.paged_case import make_case


def test_use_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    assert K.use_triton("cpu")  # conftest sets TRITON_INTERPRET=1: the calls below run the kernels
    assert K.use_triton("cuda") == K.triton_available()
    assert not K.use_triton("meta")
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not K.use_triton("cpu")


def test_functions_survive_kernel_module_imports() -> None:
    import engine.triton_kernels.paged_decode_attention  # noqa: F401  (rebinds engine.triton_kernels.<module name>)
    import engine.triton_kernels.paged_prefill_attention  # noqa: F401

    assert callable(K.decode_attention) and callable(K.prefill_attention) and callable(K.rms_norm)


def test_build_paged_batch() -> None:
    batch = K.build_paged_batch(
        [[4, 2], [7], [1, 3, 5]], seq_lens=[20, 1, 33], query_lens=[3, 1, 33], block_size=16, device="cpu"
    )
    assert batch.block_tables.dtype == torch.int32 and batch.block_tables.tolist() == [[4, 2, 0], [7, 0, 0], [1, 3, 5]]
    assert batch.cu_seqlens_q.tolist() == [0, 3, 4, 37] and batch.seq_lens.tolist() == [20, 1, 33]
    assert (batch.max_query_len, batch.max_seq_len) == (33, 33)


def test_drop_in_for_the_model_torch_path() -> None:
    x, res, w = torch.randn(5, 64), torch.randn(5, 64), torch.randn(64)
    torch.testing.assert_close(K.rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5), atol=2e-5, rtol=2e-5)
    out, res_out = K.fused_add_rms_norm(x, res, w, 1e-5)
    torch.testing.assert_close(out, rms_norm(x + res, w, 1e-5), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(res_out, x + res)

    inv = 1.0 / 10000 ** (torch.arange(0, 32, 2).float() / 32)
    freqs = torch.outer(torch.arange(40).float(), inv)
    table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # rope_cos_sin's layout
    pos = torch.tensor([0, 5, 39])
    q, k = torch.randn(3, 4, 32), torch.randn(3, 2, 32)
    eq, ek = apply_rope(q, table[pos]), apply_rope(k, table[pos])
    K.rotary_embedding(pos, q, k, table)
    torch.testing.assert_close(q, eq, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k, ek, atol=1e-6, rtol=1e-6)


def test_mixed_step_through_dispatch() -> None:
    # One step: a 5-token chunk after an 11-token prefix, and a decode at position 16 (block boundary).
    case = make_case([16, 17], kv_heads=2, head_dim=32, dtype=torch.float32)
    batch = K.build_paged_batch(case.block_tables.tolist(), [16, 17], [5, 1], block_size=16, device="cpu")
    k_new, v_new = torch.randn(6, 2, 32), torch.randn(6, 2, 32)
    rows = [int(case.block_tables[0, p // 16]) * 16 + p % 16 for p in range(11, 16)]
    rows.append(int(case.block_tables[1, 1]) * 16)
    slots = torch.tensor(rows)
    expect_k, expect_v = case.k_cache.clone(), case.v_cache.clone()
    write_kv(expect_k, expect_v, k_new, v_new, slots)  # the model's torch writer
    K.write_kv_cache(k_new, v_new, case.k_cache, case.v_cache, slots)
    assert torch.equal(case.k_cache, expect_k) and torch.equal(case.v_cache, expect_v)

    q = torch.randn(6, 4, 32)
    out = K.prefill_attention(q, case.k_cache, case.v_cache, batch, 0.2)
    ref = paged_prefill_attention_ref(
        q, case.k_cache, case.v_cache, batch.block_tables, batch.cu_seqlens_q, batch.seq_lens, 0.2
    )
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(
        K.decode_attention(
            q[5:],
            case.k_cache,
            case.v_cache,
            K.build_paged_batch([case.block_tables[1].tolist()], [17], [1], 16, "cpu"),
            0.2,
        ),
        out[5:],
        atol=2e-5,
        rtol=2e-5,
    )
