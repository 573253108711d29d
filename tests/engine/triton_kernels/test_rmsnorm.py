from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from engine.triton_kernels.rmsnorm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref

EPS = 1e-6


def test_reference_matches_transformers() -> None:
    norm = LlamaRMSNorm(96, eps=EPS)
    norm.weight.data = torch.randn(96)
    x = torch.randn(5, 96)
    torch.testing.assert_close(rms_norm_ref(x, norm.weight.data, EPS), norm(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [64, 100, 128])
def test_rms_norm(dtype: torch.dtype, hidden: int, tol: dict[torch.dtype, tuple[float, float]]) -> None:
    x = torch.randn(7, hidden).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden)).to(dtype)
    atol, rtol = tol[dtype]
    torch.testing.assert_close(rms_norm(x, w, EPS), rms_norm_ref(x, w, EPS), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rms_norm(dtype: torch.dtype, tol: dict[torch.dtype, tuple[float, float]]) -> None:
    x = torch.randn(2, 3, 96).to(dtype)  # any leading shape
    residual = torch.randn(2, 3, 96).to(dtype)
    w = torch.randn(96).to(dtype)
    out, res_out = fused_add_rms_norm(x, residual, w, EPS)
    ref_out, ref_res = fused_add_rms_norm_ref(x, residual, w, EPS)
    atol, rtol = tol[dtype]
    # One rounding of the same sum; Triton's interpreter truncates float32 -> bfloat16 (GPUs round), so 1 ulp.
    exact = dtype == torch.float32
    torch.testing.assert_close(res_out, ref_res, atol=0 if exact else atol, rtol=0 if exact else 2**-7)
    torch.testing.assert_close(out, ref_out, atol=atol, rtol=rtol)
    assert out.shape == x.shape and res_out.shape == x.shape


def test_strided_rows_and_empty() -> None:
    big = torch.randn(6, 160)
    x = big[:, :64]  # row stride 160, as a slice of a fused projection would be
    w = torch.randn(64)
    torch.testing.assert_close(rms_norm(x, w, EPS), rms_norm_ref(x, w, EPS), atol=2e-5, rtol=2e-5)
    assert rms_norm(torch.empty(0, 64), w, EPS).shape == (0, 64)
