"""engine/cpu_kernels/gemm_amx.py: AMX tiles of our own, against the exact float32 product of the same bf16
inputs (one bf16 rounding apart at most), through AmxLinear and the LM head's "amx" form. Runs where the CPU and
Linux give AMX tiles (an AMD or pre-Sapphire-Rapids CPU has none: the chooser then never sees the candidate)."""

from __future__ import annotations

import pytest
import torch

from engine.cpu_kernels import gemm_amx
from engine.layers.linear import AmxLinear, candidate_forms
from engine.layers.lm_head import LMHead, head_forms

pytestmark = pytest.mark.skipif(not gemm_amx.available(), reason="no AMX tiles on this CPU")


def is_exact_rounded(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """got within one bf16 rounding of x @ w.T + bias (exact in float64), plus what float32 sums in any order may
    lose: k units of float32's last place of the terms' magnitudes."""
    exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
    terms = x.double().abs() @ w.double().abs().T + (0 if bias is None else bias.double().abs())
    slack = exact.abs() * 2.0**-8 + terms * x.shape[-1] * 2.0**-24
    return bool(((got.double() - exact).abs() <= slack).all())


@pytest.mark.parametrize("m", [1, 15, 16, 17, 33, 100])
@pytest.mark.parametrize("n", [16, 32, 40, 96])
def test_product_is_the_exact_one_rounded(m: int, n: int) -> None:
    g = torch.Generator().manual_seed(m * 1000 + n)
    k = 96
    w, x = torch.randn(n, k, generator=g).bfloat16(), torch.randn(m, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    packed = gemm_amx.pack(w)
    for bias in (None, b):
        got = gemm_amx.matmul(x, packed, n, bias, 2)
        assert got.shape == (m, n) and got.dtype == torch.bfloat16
        assert is_exact_rounded(got, x, w, bias)
        wide = gemm_amx.matmul(x, packed, n, bias, 1, out=torch.empty(m, n))
        assert torch.equal(wide, got.float())  # the float32 form is the bf16 result widened


def test_pack_keeps_the_weight() -> None:
    w = torch.randn(40, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    packed = gemm_amx.pack(w)
    assert packed.numel() == 64 * 64  # 40 rows padded to 64
    assert torch.equal(gemm_amx.unpack(packed, 40, 64), w)


def test_out_with_a_row_stride_of_its_own_leaves_the_rest() -> None:
    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(32, 64, generator=g).bfloat16(), torch.randn(3, 64, generator=g).bfloat16()
    big = torch.full((3, 48), 7.0, dtype=torch.bfloat16)
    gemm_amx.matmul(x, gemm_amx.pack(w), 32, None, 2, out=big[:, 8:40])
    assert is_exact_rounded(big[:, 8:40], x, w)
    assert bool((big[:, :8] == 7).all() and (big[:, 40:] == 7).all())


def test_a_width_not_a_multiple_of_32_is_not_taken() -> None:
    assert not gemm_amx.takes(torch.zeros(16, 48, dtype=torch.bfloat16))
    assert not gemm_amx.takes(torch.zeros(16, 64, dtype=torch.float32))
    assert gemm_amx.takes(torch.zeros(16, 64, dtype=torch.bfloat16))
    assert "amx" not in candidate_forms(torch.zeros(16, 48, dtype=torch.bfloat16), None, None)
    assert "amx" in candidate_forms(torch.zeros(16, 64, dtype=torch.bfloat16), None, None)


def test_amx_linear_and_head() -> None:
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(72, 128, generator=g).bfloat16(), torch.randn(72, generator=g).bfloat16()
    x = torch.randn(2, 5, 128, generator=g).bfloat16()
    lin = AmxLinear(w, b)
    y = lin(x)
    assert y.shape == (2, 5, 72)
    assert is_exact_rounded(y, x, w, b)
    assert torch.equal(lin.dense_weight(), w)
    assert "amx" in head_forms(w, None)
    head = LMHead(w, None, form="amx")
    h = x.reshape(10, 128)
    out = torch.empty(16, 72)
    logits = head(h, out)
    assert logits.shape == (10, 72) and logits.data_ptr() == out.data_ptr()
    assert is_exact_rounded(logits, h, w)
