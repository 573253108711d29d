"""engine/models/decoder.py's GatedMLP: on the CPU kernel, up to a decode step's rows take the gated product
(gate|up and SiLU * up in one call) and give bitwise what the two calls give; more rows make the two calls."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from engine.cpu_kernels import gemm, layer_ops
from engine.layers.linear import KernelLinear, Linear
from engine.layers.parallel import WORKERS
from engine.models.decoder import GatedMLP

needs_kernel = pytest.mark.skipif(not gemm.available(), reason="no AVX512-BF16 CPU kernel here (CPU or compiler)")


@pytest.fixture(autouse=True)
def _one_worker() -> Iterator[None]:
    yield
    WORKERS.configure(1)


def mlp(hidden: int, inter: int, quantization: str | None, seed: int = 0) -> GatedMLP:
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(2 * inter, hidden, generator=g) / hidden**0.5).bfloat16()
    down = (torch.randn(hidden, inter, generator=g) / inter**0.5).bfloat16()
    return GatedMLP(KernelLinear(gate_up, None, quantization), KernelLinear(down, None, quantization), F.silu)


def count_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The out_features of every KernelLinear called from now on, in order."""
    calls: list[int] = []
    real = KernelLinear.__call__

    def counted(self: KernelLinear, x: torch.Tensor) -> torch.Tensor:
        calls.append(self.out_features)
        return real(self, x)

    monkeypatch.setattr(KernelLinear, "__call__", counted)
    return calls


@needs_kernel
@pytest.mark.parametrize("quantization", [None, "int8"])
@pytest.mark.parametrize("rows,workers", [(1, 1), (7, 2), (16, 2), (20, 1), (32, 2)])
def test_gated_mlp_takes_the_gated_product_up_to_32_rows(
    monkeypatch: pytest.MonkeyPatch, rows: int, workers: int, quantization: str | None
) -> None:
    WORKERS.configure(workers)
    m = mlp(128, 96, quantization)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)).bfloat16()
    want = m.down(layer_ops.silu_mul(m.gate_up(x)))  # the two calls
    calls = count_calls(monkeypatch)
    got = m(x)
    assert calls == [128]  # down alone: gate|up went through the gated product
    assert torch.equal(got, want)


@needs_kernel
def test_gated_mlp_past_32_rows_makes_the_two_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    m = mlp(128, 96, None)
    x = torch.randn(2, 20, 128, generator=torch.Generator().manual_seed(3)).bfloat16()  # 40 rows, batched shape
    want = m.down(layer_ops.silu_mul(m.gate_up(x)))
    calls = count_calls(monkeypatch)
    got = m(x)
    assert calls == [192, 128]
    assert got.shape == (2, 20, 128) and torch.equal(got, want)


def test_gated_mlp_on_a_plain_linear_is_silu_times_up() -> None:
    """float32 weights (no kernel): the reference formula, whatever the CPU."""
    g = torch.Generator().manual_seed(1)
    wgu, wd = torch.randn(64, 16, generator=g), torch.randn(16, 32, generator=g)
    x = torch.randn(5, 16, generator=g)
    got = GatedMLP(Linear(wgu), Linear(wd), F.silu)(x)
    gate, up = F.linear(x, wgu).chunk(2, dim=-1)
    assert torch.allclose(got, F.linear(F.silu(gate) * up, wd), rtol=1e-5, atol=1e-5)
