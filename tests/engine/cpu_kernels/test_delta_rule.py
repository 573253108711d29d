"""engine/cpu_kernels/delta_rule.py (the gated delta rule's one-token update in one pass over each state) against
transformers' torch_recurrent_gated_delta_rule, engine/models/recurrent/delta_decode.py's torch path and the update
written out in float64: batch sizes, shared key heads, d_k / d_v with tails and more columns than one block, slots
out of order, bf16 and float32 rows, one and two threads. Tolerance: float32 (states within 1e-5 of transformers';
outputs 1e-5 relative in float32, one bf16 step in bf16)."""

from __future__ import annotations

import pytest
import torch

from engine.cpu_kernels import delta_rule
from engine.models.recurrent.delta_decode import delta_rule_decode, torch_delta_rule_decode
from engine.models.recurrent.gated_deltanet import delta_rule_kernels

pytestmark = pytest.mark.skipif(delta_rule._kernel() is None, reason="no AVX-512 CPU kernel here (CPU or compiler)")

Rows = tuple[torch.Tensor, ...]
SHAPES = [  # (batch, key heads, value heads, d_k, d_v)
    (1, 16, 16, 128, 128),  # Qwen3.5-0.8B's
    (16, 4, 8, 128, 128),
    (3, 2, 6, 64, 40),
    (5, 1, 2, 100, 200),  # a d_k off the vector width; d_v past one 128-column block, with a tail
    (2, 3, 3, 16, 7),
]


def rows(batch: int, hk: int, hv: int, dk: int, dv: int, dtype: torch.dtype, seed: int) -> Rows:
    """q, k, v, g, beta of `batch` rows and a pool of batch + 3 states, the rows' slots shuffled."""
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(batch, hk, dk, generator=g).to(dtype) for _ in range(2))
    v = torch.randn(batch, hv, dv, generator=g).to(dtype)
    decay = -torch.rand(batch, hv, generator=g) * 2
    beta = torch.rand(batch, hv, generator=g).to(dtype)
    states = torch.randn(batch + 3, hv, dk, dv, generator=g)
    slots = torch.randperm(batch + 3, generator=g)[:batch]
    return q, k, v, decay, beta, states, slots


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_transformers(shape: tuple[int, int, int, int, int], dtype: torch.dtype) -> None:
    q, k, v, decay, beta, states, slots = rows(*shape, dtype, seed=sum(shape))
    _, recurrent = delta_rule_kernels()
    want, final = recurrent(
        q[:, None], k[:, None], v[:, None], g=decay[:, None], beta=beta[:, None],
        initial_state=states[slots], output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    before = states.clone()
    got = delta_rule.decode(q, k, v, decay, beta, states, slots, threads=2)
    assert got.dtype == dtype and final is not None
    torch.testing.assert_close(states[slots], final, rtol=1e-5, atol=1e-5)
    rtol = 1e-5 if dtype == torch.float32 else 8e-3  # bf16 outputs: one rounding step
    torch.testing.assert_close(got.float(), want[:, 0].float(), rtol=rtol, atol=1e-5)
    others = [i for i in range(states.shape[0]) if i not in slots.tolist()]
    assert torch.equal(states[others], before[others])  # only the rows' slots move


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_torch_path_and_float64(shape: tuple[int, int, int, int, int], threads: int) -> None:
    q, k, v, decay, beta, states, slots = rows(*shape, torch.float32, seed=threads)
    want_out, want_states = delta_rule.reference(q, k, v, decay, beta, states[slots])
    torch_states = states.clone()
    torch_out = torch_delta_rule_decode(q, k, v, decay, beta, torch_states, slots)
    got = delta_rule.decode(q, k, v, decay, beta, states, slots, threads)
    torch.testing.assert_close(got, torch_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states, torch_states, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.double(), want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states[slots].double(), want_states, rtol=1e-5, atol=1e-5)


def test_strided_rows_as_the_mixer_splits_them() -> None:
    """q, k, v as views of one q|k|v row (the mixer's split, no copy), repeated steps on the same slots."""
    hk, hv, dk, dv = 2, 4, 32, 48
    g = torch.Generator().manual_seed(7)
    mixed = torch.randn(3, 2 * hk * dk + hv * dv, generator=g).bfloat16()
    q, k, v = torch.split(mixed, [hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.view(3, hk, dk), k.view(3, hk, dk), v.view(3, hv, dv)
    assert not q.is_contiguous()
    decay, beta = -torch.rand(3, hv, generator=g), torch.rand(3, hv, generator=g).bfloat16()
    states = torch.randn(4, hv, dk, dv, generator=g)
    torch_states, slots = states.clone(), torch.tensor([3, 0, 2])
    for _ in range(3):
        got = delta_rule.decode(q, k, v, decay, beta, states, slots, threads=2)
        want = torch_delta_rule_decode(q, k, v, decay, beta, torch_states, slots)
        torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=1e-5)
    torch.testing.assert_close(states, torch_states, rtol=1e-5, atol=1e-5)


def test_decode_takes_the_kernel_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """delta_rule_decode runs the kernel where it is usable (the torch path otherwise)."""
    q, k, v, decay, beta, states, slots = rows(2, 2, 2, 16, 16, torch.float32, seed=3)
    calls: list[int] = []
    real = delta_rule.decode

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(delta_rule, "decode", spy)
    delta_rule_decode(q, k, v, decay, beta, states, slots)
    assert calls == [1]
    assert not delta_rule.usable(q.half(), k.half(), v.half(), states)  # float16 rows: the torch path
    assert not delta_rule.usable(q, k, v, states.transpose(-1, -2))  # a state not row-major per head
