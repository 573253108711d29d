"""engine/cpu_kernels/quant_dot: 4-bit blocks packed for bf16 dot products; the packed weights dequantize to
gguf's bit for bit, products of bf16 rows are the reference's within float32 rounding, and quant_gemm's entry
point takes the packed form by its type code (the fused decode layer calls that one)."""

from __future__ import annotations

import gguf
import pytest
import torch

from engine.cpu_kernels import quant_dot, quant_gemm

T = gguf.GGMLQuantizationType
TYPES = [T.Q4_0, T.Q4_1]

pytestmark = pytest.mark.skipif(
    not all(quant_dot.supports(int(t)) for t in TYPES), reason="the bf16 dot-product kernel does not run here"
)


def blocks(ggml_type: int, n: int, k: int, seed: int) -> torch.Tensor:
    return quant_gemm.random_blocks(int(ggml_type), n, k, torch.Generator().manual_seed(seed))


def within_rounding(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    exact = x.double() @ w.double().t()
    bound = 64 * 2.0**-24 * (x.double().abs() @ w.double().abs().t())
    if got.dtype is torch.bfloat16:
        bound = bound + 2.0**-8 * exact.abs()
    err = (got.double() - exact).abs()
    assert (err <= bound).all(), f"max error {err.max().item():.3g}"


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(("n", "k"), [(1, 32), (4, 64), (7, 96), (13, 1536)])
def test_packed_weights_dequantize_to_the_reference(ggml_type: int, n: int, k: int) -> None:
    data = blocks(ggml_type, n, k, n + k)
    want = quant_gemm.reference(data, int(ggml_type))
    packed = quant_dot.pack(data, int(ggml_type), k)
    assert packed.numel() == (n + 3) // 4 * 4 * data.shape[1]  # the file's bytes, columns padded to groups of 4
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(quant_dot.dequantize(packed, int(ggml_type), n, k, 0, n, dtype), want.to(dtype))
    for start, end in ((0, 0), (1, n), (n // 2, n), (n - 1, n)):  # rows starting inside a group
        got = quant_dot.dequantize(packed, int(ggml_type), n, k, start, end, torch.float32)
        assert torch.equal(got, want[start:end])


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 16, 33])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_products_of_bf16_rows_against_the_reference(ggml_type: int, rows: int, out_dtype: torch.dtype) -> None:
    n, k = 22, 160
    data = blocks(ggml_type, n, k, rows)
    want = quant_gemm.reference(data, int(ggml_type))
    packed = quant_dot.pack(data, int(ggml_type), k)
    x = (torch.randn(rows, k, generator=torch.Generator().manual_seed(7)) * 3).bfloat16()
    for threads in (1, 2):
        y = torch.empty(rows, n, dtype=out_dtype)
        quant_dot.matmul(x, packed, int(ggml_type), n, y, threads)
        within_rounding(y, x, want)
    # a strided x and out (rows of a wider buffer)
    wide_x = torch.zeros(rows, k + 32, dtype=torch.bfloat16)
    wide_x[:, :k] = x
    wide_y = torch.full((rows, n + 5), 7.0, dtype=out_dtype)
    quant_dot.matmul(wide_x[:, :k], packed, int(ggml_type), n, wide_y[:, :n], 2)
    within_rounding(wide_y[:, :n], x, want)
    assert (wide_y[:, n:] == 7).all()


def test_quant_gemm_takes_the_packed_form_by_its_type_code() -> None:
    n, k, t = 9, 64, int(T.Q4_1)
    data = blocks(t, n, k, 3)
    packed = quant_dot.pack(data, t, k)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(4)).bfloat16()
    raw = quant_gemm.raw_product()
    y = torch.empty(2, n, dtype=torch.bfloat16)
    assert raw(quant_dot.PACKED + t, x.data_ptr(), 1, k, 2, k, packed.data_ptr(), 0, n, y.data_ptr(), 1, n, 1) == 0
    direct = torch.empty(2, n, dtype=torch.bfloat16)
    quant_dot.matmul(x, packed, t, n, direct, 1)
    assert torch.equal(y, direct)
    # float32 activations are refused (nonzero, nothing written): the packed form takes bf16 only
    x32, y32 = x.float(), torch.full((2, n), 5.0)
    assert raw(quant_dot.PACKED + t, x32.data_ptr(), 0, k, 2, k, packed.data_ptr(), 0, n, y32.data_ptr(), 0, n, 1)
    assert (y32 == 5).all()


def test_other_types_are_not_packed() -> None:
    assert not quant_dot.supports(int(T.Q8_0)) and not quant_dot.supports(int(T.Q4_K))
    with pytest.raises(ValueError):
        quant_dot.pack(blocks(T.Q8_0, 4, 32, 1), int(T.Q8_0), 32)
