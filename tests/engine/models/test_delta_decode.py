"""The decode update of the gated delta rule against transformers' recurrent reference, one token: the dispatcher
(the C++ kernel where it runs) and the torch path it falls back to."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from engine.models.recurrent.delta_decode import delta_rule_decode, torch_delta_rule_decode
from engine.models.recurrent.gated_deltanet import delta_rule_kernels


@pytest.mark.parametrize(
    ("rows", "k_heads", "v_heads", "dtype"),
    [(1, 4, 4, torch.bfloat16), (3, 2, 4, torch.float32), (4, 4, 4, torch.bfloat16)],
)
@pytest.mark.parametrize("decode", [delta_rule_decode, torch_delta_rule_decode])
def test_decode_matches_reference(
    rows: int, k_heads: int, v_heads: int, dtype: torch.dtype, decode: Callable[..., torch.Tensor]
) -> None:
    g = torch.Generator().manual_seed(rows)
    dk, dv = 32, 16
    states = torch.randn(6, v_heads, dk, dv, generator=g)
    q, k = (torch.randn(rows, k_heads, dk, generator=g).to(dtype) for _ in range(2))
    v = torch.randn(rows, v_heads, dv, generator=g).to(dtype)
    decay, beta = -torch.rand(rows, v_heads, generator=g), torch.rand(rows, v_heads, generator=g).to(dtype)
    slots = torch.tensor([4, 1, 0, 5][:rows] if rows < 4 else [1, 2, 3, 4])  # 4 rows: consecutive slots, a view
    _, recurrent = delta_rule_kernels()
    ref, final = recurrent(
        q[:, None], k[:, None], v[:, None], g=decay[:, None], beta=beta[:, None],
        initial_state=states[slots], output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    before = states.clone()
    out = decode(q, k, v, decay, beta, states, slots)
    assert out.dtype == dtype
    torch.testing.assert_close(
        out.float(), ref[:, 0].float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-4
    )
    assert final is not None
    torch.testing.assert_close(states[slots], final, rtol=1e-5, atol=1e-5)
    others = [i for i in range(6) if i not in slots.tolist()]
    assert torch.equal(states[others], before[others])  # only the rows' slots move
