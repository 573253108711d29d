"""engine/cpu_kernels/quant_dot: GGUF blocks packed for bf16 dot products; the packed weights dequantize to gguf's
bit for bit (random blocks and the real Gemma-3 file's), products of 1..33 bf16 rows are the reference's within
float32 rounding on 1 and 2 threads, and quant_gemm's entry point takes the packed form by its type code (the
fused decode layer calls that one) and refuses float32 activations there."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from engine.cpu_kernels import quant_dot, quant_gemm
from engine.gguf.header import open_mapped, read_header
from tests.engine.gguf.files import gemma3_file

T = gguf.GGMLQuantizationType
TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
K_QUANTS = {T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K}

pytestmark = pytest.mark.skipif(
    not all(quant_dot.supports(int(t)) for t in TYPES), reason="the bf16 dot-product kernel does not run here"
)


def blocks(ggml_type: int, n: int, k: int, seed: int) -> torch.Tensor:
    return quant_gemm.random_blocks(int(ggml_type), n, k, torch.Generator().manual_seed(seed))


def width(ggml_type: int, times: int) -> int:
    """An input width of `times` blocks of the type (K-quants: 256 weights a block)."""
    return times * quant_gemm.block_shape(int(ggml_type))[0]


def within_rounding(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    exact = x.double() @ w.double().t()
    bound = 64 * 2.0**-24 * (x.double().abs() @ w.double().abs().t())
    if got.dtype is torch.bfloat16:
        bound = bound + 2.0**-8 * exact.abs()
    err = (got.double() - exact).abs()
    assert (err <= bound).all(), f"max error {err.max().item():.3g}"


def same_dequantization(data: torch.Tensor, ggml_type: int, k: int) -> None:
    n = data.shape[0]
    want = quant_gemm.reference(data, ggml_type)
    packed = quant_dot.pack(data, ggml_type, k)
    # the file's bytes (columns padded to groups of 4); K-quants' 6-bit scales unpacked to bytes: at most 4% more
    file_bytes = (n + 3) // 4 * 4 * data.shape[1]
    assert file_bytes <= packed.numel() <= 1.04 * file_bytes
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(quant_dot.dequantize(packed, ggml_type, n, k, 0, n, dtype), want.to(dtype))
    for start, end in ((0, 0), (1, n), (n // 2, n), (n - 1, n)):  # rows starting inside a group
        got = quant_dot.dequantize(packed, ggml_type, n, k, start, end, torch.float32)
        assert torch.equal(got, want[start:end])


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(("n", "blocks_per_row"), [(1, 1), (4, 2), (7, 3), (13, 5)])
def test_packed_weights_dequantize_to_the_reference(ggml_type: int, n: int, blocks_per_row: int) -> None:
    k = width(ggml_type, blocks_per_row)
    same_dequantization(blocks(ggml_type, n, k, n + k), int(ggml_type), k)


def test_real_gemma_blocks_dequantize_to_the_reference() -> None:
    """Every block type of the real Gemma-3 Q4_K_M file (the first 33 rows of one tensor of each)."""
    path = gemma3_file()
    mapped = open_mapped(path)
    seen = set()
    for t in read_header(path, mapped).tensors.values():
        if len(t.shape) == 2 and t.ggml_type not in seen and t.ggml_type in quant_dot.TYPES:
            seen.add(t.ggml_type)
            raw = np.frombuffer(mapped, dtype=np.uint8, count=t.nbytes, offset=t.offset).reshape(t.shape[0], -1)
            same_dequantization(torch.from_numpy(raw[:33].copy()), t.ggml_type, t.shape[1])
    assert seen == {int(T.Q8_0), int(T.Q5_0), int(T.Q4_K), int(T.Q6_K)}


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 16, 17, 33])
def test_products_of_bf16_rows_against_the_reference(ggml_type: int, rows: int) -> None:
    n, k = 22, width(ggml_type, 2 if ggml_type in K_QUANTS else 5)  # 22: the last group of 4 columns half full
    data = blocks(ggml_type, n, k, rows)
    want = quant_gemm.reference(data, int(ggml_type))
    packed = quant_dot.pack(data, int(ggml_type), k)
    x = (torch.randn(rows, k, generator=torch.Generator().manual_seed(7)) * 3).bfloat16()
    for out_dtype in (torch.float32, torch.bfloat16):
        for threads in (1, 2):
            y = torch.empty(rows, n, dtype=out_dtype)
            quant_dot.matmul(x, packed, int(ggml_type), n, y, threads)
            within_rounding(y, x, want)
    # a strided x and out (rows of a wider buffer)
    wide_x = torch.zeros(rows, k + 32, dtype=torch.bfloat16)
    wide_x[:, :k] = x
    wide_y = torch.full((rows, n + 5), 7.0, dtype=torch.bfloat16)
    quant_dot.matmul(wide_x[:, :k], packed, int(ggml_type), n, wide_y[:, :n], 2)
    within_rounding(wide_y[:, :n], x, want)
    assert (wide_y[:, n:] == 7).all()


@pytest.mark.skipif(not quant_dot.tiles_usable(), reason="no AMX tiles here")
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 7, 16, 17, 33, 64, 70])
def test_products_through_tiles_against_the_reference(ggml_type: int, rows: int) -> None:
    # 37 columns: a last block of 16 with 5; rows past a tile of 16 and past the 64 of one pass
    k = width(ggml_type, 3)
    data = blocks(ggml_type, 37, k, rows)
    want = quant_gemm.reference(data, int(ggml_type))
    packed = quant_dot.pack(data, int(ggml_type), k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    for threads in (1, 2):
        for dtype in (torch.float32, torch.bfloat16):
            y = torch.full((rows, 37), float("nan"), dtype=dtype)
            quant_dot.matmul(x, packed, int(ggml_type), 37, y, threads, tiles_from=1)
            within_rounding(y, x, want)
    wide = torch.full((rows, 40), -1.0)  # a row stride past the columns: only [:, :37] written
    quant_dot.matmul(x, packed, int(ggml_type), 37, wide[:, :37], 2, tiles_from=1)
    within_rounding(wide[:, :37], x, want)
    assert (wide[:, 37:] == -1.0).all()


def test_tiles_from_a_row_count_by_the_type_code() -> None:
    # the type code's rows from which tiles run: below them the AVX-512 path, bit for bit
    t, k = int(T.Q4_K), 256
    data = blocks(t, 20, k, 5)
    packed = quant_dot.pack(data, t, k)
    x = torch.randn(8, k, generator=torch.Generator().manual_seed(6)).bfloat16()
    plain, below, tiled, always = (torch.empty(8, 20) for _ in range(4))
    quant_dot.matmul(x, packed, t, 20, plain, 1)
    quant_dot.matmul(x, packed, t, 20, below, 1, tiles_from=9)
    from_rows = 8 if quant_dot.tiles_usable() else 0
    quant_dot.matmul(x, packed, t, 20, tiled, 1, tiles_from=from_rows)
    quant_dot.matmul(x, packed, t, 20, always, 1, tiles_from=from_rows and 1)
    assert torch.equal(plain, below) and torch.equal(tiled, always)
    within_rounding(tiled, x, quant_gemm.reference(data, t))


@pytest.mark.parametrize("ggml_type", [T.Q8_0, T.Q6_K, T.Q3_K], ids=lambda t: t.name)
def test_quant_gemm_takes_the_packed_form_by_its_type_code(ggml_type: int) -> None:
    n, k, t = 9, width(ggml_type, 1), int(ggml_type)
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
    with pytest.raises(TypeError):
        quant_dot.matmul(x32, packed, t, n, y32, 1)


def test_other_types_are_not_packed() -> None:
    assert not quant_dot.supports(int(T.Q8_1)) and not quant_dot.supports(int(T.IQ4_NL))
    with pytest.raises(ValueError):
        quant_dot.pack(torch.zeros(4, 36, dtype=torch.uint8), int(T.Q8_1), 32)
