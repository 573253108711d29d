"""LoRA shrink / expand under TRITON_INTERPRET=1 against their torch references, and LoRALinear's Triton path
against its torch path: ranks 8-64, segments of 0, 1 and many rows, rows of the base between them."""

from __future__ import annotations

import pytest
import torch

from engine.layers.linear import Linear
from engine.lora.adapter import ModuleWeights
from engine.lora.layer import LoRALinear
from engine.lora.mapping import LoRAContext, build_mapping
from engine.triton_kernels.lora import lora_expand, lora_expand_ref, lora_shrink, lora_shrink_ref

# (first row, rows, slot) per sequence: slot 1 has 37 rows over two sequences (3 tiles), slot 2 one row,
# slot 3 none (a segment of length 0), -1 rows are the base's
SEQS = [(0, 5, -1), (5, 30, 1), (35, 1, 2), (36, 4, -1), (40, 7, 1), (47, 0, 3), (47, 2, 0)]
T = 49


@pytest.mark.parametrize("rank", [8, 16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shrink_expand_match_reference(
    rank: int, dtype: torch.dtype, tol: dict[torch.dtype, tuple[float, float]]
) -> None:
    slots, k, out = 4, 72, 40
    m = build_mapping(SEQS, {s: rank for s in range(slots)}, torch.device("cpu"))
    assert m is not None and [s.slot for s in m.segments] == [0, 1, 2]
    assert sorted(m.rows.tolist()) == [r for f, n, s in SEQS if s >= 0 for r in range(f, f + n)]
    x = torch.randn(T, k).to(dtype)
    a = torch.randn(slots, 64, k).to(dtype) / k**0.5
    b = torch.randn(slots, out, 64).to(dtype)
    scaling = torch.tensor([0.5, 2.0, 1.0, 3.0])
    atol, rtol = tol[dtype]
    h = lora_shrink(x, a, m.rows, m.tiles, rank)
    h_ref = lora_shrink_ref(x, a, m.rows, m.tiles, rank)
    torch.testing.assert_close(h, h_ref, atol=atol, rtol=rtol)
    y = torch.randn(T, out + 8).to(dtype)  # a column view, as a packed member's slice
    y_ref = y.clone()
    lora_expand(h_ref, b, scaling, y[:, 8:], m.rows, m.tiles)
    lora_expand_ref(h_ref, b, scaling, y_ref[:, 8:], m.rows, m.tiles)
    torch.testing.assert_close(y, y_ref, atol=atol * 4, rtol=rtol)
    base_rows = [r for f, n, s in SEQS if s < 0 for r in range(f, f + n)]
    assert torch.equal(y[base_rows], y_ref[base_rows]) and torch.equal(y[:, :8], y_ref[:, :8])


def test_base_only_step_has_no_mapping() -> None:
    assert build_mapping([(0, 3, -1), (3, 1, -1)], {}, torch.device("cpu")) is None


@pytest.mark.parametrize("rank", [8, 32])
def test_layer_triton_path_equals_torch_path(rank: int) -> None:
    hidden, q, kv = 48, 32, 16
    ctx = LoRAContext()
    base = Linear(torch.randn(q + 2 * kv, hidden))
    lin = LoRALinear(
        base,
        [("q_proj", 0, q), ("k_proj", q, q + kv), ("v_proj", q + kv, q + 2 * kv)],
        3,
        64,
        torch.float32,
        torch.device("cpu"),
        ctx,
    )
    for slot, names in ((0, ("q_proj", "v_proj")), (2, ("k_proj",))):
        lin.load(
            slot,
            {
                n: ModuleWeights(
                    torch.randn(rank, hidden),
                    torch.randn(base.out_features if n == "x" else (q if n == "q_proj" else kv), rank),
                    0.25 * (slot + 1),
                )
                for n in names
            },
        )
    x = torch.randn(20, hidden)
    ctx.mapping = build_mapping([(0, 6, 0), (6, 3, -1), (9, 11, 2)], {0: rank, 2: rank}, torch.device("cpu"))
    torch_out = lin(x)
    ctx.use_triton = True
    triton_out = lin(x)
    torch.testing.assert_close(triton_out, torch_out, atol=1e-4, rtol=1e-4)
    ctx.mapping = None
    assert torch.equal(lin(x), base(x))
    assert not torch.allclose(torch_out, base(x))
