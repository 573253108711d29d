"""layer_ops.cpp's Gemma ops against the torch code they replace on the Gemma 2 / 3 path: the (1 + w) float32 RMSNorm
(engine/models/decoder.py gemma_rms_norm) and GELU-tanh(gate) * up (F.gelu(approximate="tanh"))."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.cpu_kernels import layer_ops
from engine.models.decoder import gemma_rms_norm

pytestmark = pytest.mark.skipif(not layer_ops.available(), reason="no AVX512-BF16 CPU kernels here (CPU or compiler)")


@pytest.mark.parametrize("n", [40, 256, 640])
def test_gemma_rms_norm_rounds_as_torch(n: int) -> None:
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(9, n, generator=g) * 4).bfloat16()
    w = 1.0 + torch.randn(n, generator=g)
    got, want = layer_ops.gemma_rms_norm(x, w, 1e-6), gemma_rms_norm(x, w, 1e-6)
    # only the float32 sum of squares is taken in another order: at most one bf16 step, rarely
    assert (got != want).float().mean() < 0.01
    assert torch.allclose(got.float(), want.float(), rtol=8e-3, atol=0)


def test_gemma_rms_norm_of_heads_in_a_strided_view() -> None:
    """q of a fused q|k|v row, viewed [T, heads, d]: normed per head as torch does."""
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(3, 4 * 32 + 64, generator=g).bfloat16()
    q = qkv[:, : 4 * 32].view(3, 4, 32)
    w = 1.0 + torch.randn(32, generator=g)
    assert torch.allclose(layer_ops.gemma_rms_norm(q, w, 1e-6).float(), gemma_rms_norm(q, w, 1e-6).float(), rtol=8e-3)


def test_gelu_tanh_mul_rounds_as_torch() -> None:
    g = torch.Generator().manual_seed(2)
    gu = (torch.randn(33, 2 * 600, generator=g) * 3).bfloat16()
    got = layer_ops.gelu_tanh_mul(gu)
    gate, up = gu[:, :600], gu[:, 600:]
    want = F.gelu(gate, approximate="tanh") * up
    moderate = gate.float().abs() < 4  # beyond, gelu is below 1e-4 and tanh's last float32 bits show
    assert torch.equal(got[moderate], want[moderate])
    assert torch.allclose(got.float(), want.float(), rtol=0, atol=1e-5)
