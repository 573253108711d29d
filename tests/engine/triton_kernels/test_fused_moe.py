"""The fused MoE Triton kernels (interpreter) against the torch path (engine/layers/moe.py's grouped experts):
several tokens per expert, experts that get no token, shapes that are not multiples of the blocks, both
activations, routing weights in float32 (Mixtral) and in the model dtype (Qwen3-MoE)."""

from __future__ import annotations

import pytest
import torch

from engine.layers.moe import ACTIVATIONS, SparseMoE, grouped_experts
from engine.triton_kernels.fused_moe import align, fused_moe

E, HIDDEN, INTER = 6, 48, 40
IDLE = (1, 4)  # experts no token is routed to


def routing(t: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(t)
    busy = torch.tensor([e for e in range(E) if e not in IDLE])
    ids = torch.stack([busy[torch.randperm(len(busy), generator=g)[:k]] for _ in range(t)])
    weights = torch.softmax(torch.randn(t, k, generator=g), dim=-1)
    return weights, ids


def test_align_groups_pairs_by_expert_in_whole_blocks() -> None:
    ids = torch.tensor([[2, 0], [2, 5], [0, 2]])
    rows, experts = align(ids, E, block_m=4)
    assert experts.tolist() == [0, 2, 5]  # idle experts get no block
    assert rows.tolist() == [1, 4, 6, 6, 0, 2, 5, 6, 3, 6, 6, 6]  # pair t * k + j; 6 pads
    for block, e in enumerate(experts.tolist()):
        pairs = [r for r in rows[block * 4 : (block + 1) * 4].tolist() if r < 6]
        assert all(ids.flatten()[p] == e for p in pairs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("t,k,weights_in_model_dtype", [(1, 2, False), (7, 2, True), (19, 3, False)])
def test_fused_moe_matches_the_torch_path(
    dtype: torch.dtype, activation: str, t: int, k: int, weights_in_model_dtype: bool
) -> None:
    x = torch.randn(t, HIDDEN).to(dtype)
    gate_up = (torch.randn(E, 2 * INTER, HIDDEN) / HIDDEN**0.5).to(dtype)
    down = (torch.randn(E, HIDDEN, INTER) / INTER**0.5).to(dtype)
    weights, ids = routing(t, k)
    if weights_in_model_dtype:
        weights = weights.to(dtype)
    ours = fused_moe(x, gate_up, down, weights, ids, activation)
    ref = grouped_experts(x, gate_up, down, weights, ids, ACTIVATIONS[activation])
    assert ours.dtype == dtype and ours.shape == (t, HIDDEN)
    atol, rtol = (2e-5, 2e-5) if dtype == torch.float32 else (3e-2, 3e-2)
    torch.testing.assert_close(ours, ref, atol=atol, rtol=rtol)
    # an idle expert's weights are never read: poisoning them changes nothing
    gate_up[list(IDLE)] = float("nan")
    torch.testing.assert_close(fused_moe(x, gate_up, down, weights, ids, activation), ours, atol=0, rtol=0)


def test_moe_block_routes_through_the_kernel_on_the_triton_path() -> None:
    router = torch.randn(E, HIDDEN)
    gate_up, down = torch.randn(E, 2 * INTER, HIDDEN) / 7, torch.randn(E, HIDDEN, INTER) / 7
    moe = SparseMoE(router, gate_up, down, top_k=2, norm_topk_prob=True, weights_in_model_dtype=False)
    x = torch.randn(9, HIDDEN)
    ref = moe(x)
    moe.use_triton = True
    torch.testing.assert_close(moe(x), ref, atol=2e-5, rtol=2e-5)
