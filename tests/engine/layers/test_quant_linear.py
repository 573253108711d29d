"""engine/layers/quant_linear: projections and embeddings over GGUF blocks, the candidates ("ggml", "dequant", and
the packed "dot", "dot_tiles", "dot_dequant" of every packed type) against gguf's dequantized weights, both
layouts offered to the chooser, fused parts of mixed types, the bias's single rounding, make_linear's dispatch, a
type the kernel refuses, embedding rows equal to the reference exactly, and a tied table read from its packed LM
head."""

from __future__ import annotations

import gguf
import pytest
import torch
import torch.nn.functional as F

from engine.cpu_kernels import chooser, quant_dot, quant_gemm
from engine.gguf.tensor import GGMLWeight
from engine.layers import quant_linear
from engine.layers.linear import make_linear
from engine.layers.quant_linear import QuantEmbedding, QuantLinear, QuantPartsLinear, make_quant_linear

T = gguf.GGMLQuantizationType


def weight(ggml_type: int, out_features: int, in_features: int, seed: int) -> GGMLWeight:
    data = quant_gemm.random_blocks(ggml_type, out_features, in_features, torch.Generator().manual_seed(seed))
    return GGMLWeight(int(ggml_type), (out_features, in_features), data)


def reference(w: GGMLWeight) -> torch.Tensor:
    return quant_gemm.reference(w.data, w.ggml_type)


def weights_used(w: GGMLWeight, candidate: str, dtype: torch.dtype) -> torch.Tensor:
    """The weights a product sees: gguf's float32 ones in registers ("ggml"); "dequant" rounds them to the
    activations' dtype first (torch's GEMM then takes them)."""
    return reference(w) if candidate == "ggml" else reference(w).to(dtype).float()


def assert_close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """Within float32 summation error of the exact x @ w.T + bias, plus one rounding to got's dtype."""
    x2 = x.reshape(-1, x.shape[-1]).double()
    exact = x2 @ w.double().t() + (0 if bias is None else bias.double())
    bound = (
        (x2.shape[1] + 1) * 2.0**-24 * (x2.abs() @ w.double().abs().t() + (0 if bias is None else bias.double().abs()))
    )
    if got.dtype is torch.bfloat16:
        bound = bound + 2.0**-8 * (exact.abs() + bound)
    err = (got.reshape(exact.shape).double() - exact).abs()
    assert (err <= bound).all(), f"max error {err.max().item():.3g}"


@pytest.fixture(params=["ggml", "dequant"])
def candidate(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(chooser.FORCE_ENV, request.param)
    if request.param == "ggml" and not quant_gemm.supports(int(T.Q4_1)):
        pytest.skip("the quantized kernel does not run on this machine")
    return str(request.param)


@pytest.mark.parametrize("ggml_type", [T.Q8_0, T.Q4_1, T.Q4_K, T.Q6_K, T.Q5_0], ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_both_candidates_against_the_reference(candidate: str, ggml_type: int, dtype: torch.dtype) -> None:
    block, _ = quant_gemm.block_shape(ggml_type)
    w = weight(ggml_type, 45, 2 * max(block, 64), int(ggml_type))
    lin = make_quant_linear(w, None, dtype)
    assert isinstance(lin, QuantLinear) and set(lin.choice(dtype)) == {candidate}
    g = torch.Generator().manual_seed(0)
    for rows in (1, 2, 4, 16, 65):
        x = torch.randn(rows, w.shape[1], generator=g).to(dtype)
        y = lin(x)
        assert y.dtype is dtype and y.shape == (rows, 45)
        assert_close(y, x, weights_used(w, candidate, dtype))
    assert torch.equal(lin.dense_weight(), reference(w).to(dtype))


def test_batched_input_shape_and_bias_rounded_once(candidate: str) -> None:
    w = weight(T.Q4_1, 33, 64, 1)
    bias = torch.randn(33, generator=torch.Generator().manual_seed(1)) * 4
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(2))
    y32 = make_quant_linear(w, bias, torch.float32)(x)
    assert y32.shape == (2, 3, 33)
    assert_close(y32, x, reference(w), bias)
    yb = make_quant_linear(w, bias.bfloat16(), torch.bfloat16)(x.bfloat16())
    assert_close(yb, x.bfloat16(), weights_used(w, candidate, torch.bfloat16), bias.bfloat16())


def test_fused_parts_of_mixed_types(candidate: str) -> None:
    parts = [weight(T.Q4_K, 24, 256, 3), weight(T.Q6_K, 8, 256, 4), weight(T.Q8_0, 8, 256, 5)]
    bias = torch.randn(40, generator=torch.Generator().manual_seed(6))
    lin = make_quant_linear(parts, bias, torch.float32)
    assert isinstance(lin, QuantPartsLinear) and (lin.out_features, lin.in_features) == (40, 256)
    dense = torch.cat([reference(p) for p in parts])
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(7))
    assert_close(lin(x), x, dense, bias)
    assert torch.equal(lin.dense_weight(), dense)


def test_make_linear_hands_gguf_weights_over(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(chooser.FORCE_ENV, "dequant")
    w = weight(T.Q8_0, 16, 64, 8)
    lin = make_linear(w, None)  # type: ignore[arg-type]  # the loader hands GGMLWeight through the tensor slot
    assert isinstance(lin, QuantLinear)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(9))
    assert_close(lin(x), x, reference(w))
    assert isinstance(make_linear([w, weight(T.Q4_0, 8, 64, 10)], None), QuantPartsLinear)  # type: ignore[arg-type]


def test_a_type_the_kernel_refuses_runs_dequantized(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(chooser.FORCE_ENV, raising=False)
    monkeypatch.setattr(quant_gemm, "supports", lambda ggml_type: False)
    w = weight(T.Q5_1, 21, 64, 11)
    lin = make_quant_linear(w, None, torch.bfloat16)
    assert isinstance(lin, QuantLinear) and set(lin.choice(torch.bfloat16)) == {"dequant"}
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(12)).bfloat16()
    assert_close(lin(x), x, reference(w).bfloat16().float())
    # an F16 weight (no block kernel at all) goes the same way
    dense = torch.randn(6, 32, generator=torch.Generator().manual_seed(13)).half()
    f16 = GGMLWeight(int(T.F16), (6, 32), dense.view(torch.uint8).reshape(6, 64))
    x32 = torch.randn(2, 32, generator=torch.Generator().manual_seed(14))
    assert_close(make_quant_linear(f16, None, torch.float32)(x32), x32, dense.float())


def test_the_chooser_decides_per_row_class(monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    if not quant_gemm.supports(int(T.Q4_1)):
        pytest.skip("the quantized kernel does not run on this machine")
    monkeypatch.delenv(chooser.FORCE_ENV, raising=False)
    monkeypatch.setenv("SPINDLE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(chooser, "SAMPLES", 1)
    monkeypatch.setattr(chooser, "SAMPLE_S", 1e-4)
    chooser.forget()
    lin = make_quant_linear(weight(T.Q4_1, 32, 64, 15), None, torch.float32)
    assert isinstance(lin, QuantLinear)
    picked = lin.choice(torch.float32)
    assert len(picked) == len(chooser.ROW_CLASSES) and set(picked) <= {"ggml", "dequant"}
    assert picked[0] == "ggml" and picked[-1] == "dequant"  # each the only candidate there (quant_linear's ranges)
    assert any(kind == "ggml_Q4_1_float32" for kind, _, _ in chooser.choices_made())
    # a weight past CHOOSER_BYTES is timed on its first rows, its choice filed under its whole shape
    monkeypatch.setattr(quant_linear, "CHOOSER_BYTES", 64 * 40)
    w = weight(T.Q4_1, 200, 64, 16)
    big = make_quant_linear(w, None, torch.bfloat16)
    assert isinstance(big, QuantLinear)
    first = big.choice(torch.bfloat16)[0]
    # at one row only the products in registers are candidates; the layout held is that of the winners
    assert first in quant_linear.IN_REGISTERS
    held = {quant_linear.FORM_OF[c] for c in big.choice(torch.bfloat16)}
    assert held == {"packed" if big.packed is not None else "blocks"}
    assert ("ggml_Q4_1_bfloat16", (200, 64)) in [(kind, shape) for kind, shape, _ in chooser.choices_made()]
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(21)).bfloat16()
    used = "ggml" if big.choice(torch.bfloat16)[chooser.row_class(3)] in quant_linear.IN_REGISTERS else "dequant"
    assert_close(big(x), x, weights_used(w, used, torch.bfloat16))
    chooser.forget()


@pytest.mark.parametrize("ggml_type", [T.Q8_0, T.Q6_K, T.Q4_K, T.Q5_0], ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_embedding_rows_equal_the_reference(ggml_type: int, dtype: torch.dtype) -> None:
    block, _ = quant_gemm.block_shape(ggml_type)
    w = weight(ggml_type, 50, block * 2, 16)
    emb = QuantEmbedding(w, dtype)
    ids = torch.tensor([[3, 49, 3], [0, 17, 17]])
    got = emb(ids)
    assert got.shape == (2, 3, block * 2) and got.dtype is dtype
    assert torch.equal(got, reference(w).to(dtype)[ids])
    with pytest.raises(IndexError):
        emb(torch.tensor([50]))


def test_dequantized_tiles_cover_every_row(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(chooser.FORCE_ENV, "dequant")
    monkeypatch.setattr(quant_linear, "DEQUANT_TILE_BYTES", 64 * 4 * 16)  # 16 rows a tile: 3 tiles and a part
    w = weight(T.Q8_0, 53, 64, 17)
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(18))
    y = make_quant_linear(w, None, torch.float32)(x)
    assert_close(y, x, reference(w))
    assert torch.allclose(y, F.linear(x, reference(w)), rtol=1e-5, atol=1e-5)


def test_input_shapes_and_strides(candidate: str) -> None:
    w = weight(T.Q8_0, 19, 64, 19)
    lin = make_quant_linear(w, None, torch.bfloat16)
    g = torch.Generator().manual_seed(20)
    x3 = torch.randn(2, 3, 64, generator=g).bfloat16()
    assert_close(lin(x3), x3, weights_used(w, candidate, torch.bfloat16))
    assert lin(x3).shape == (2, 3, 19)
    x1 = torch.randn(64, generator=g).bfloat16()
    assert lin(x1).shape == (19,)
    assert_close(lin(x1), x1[None], weights_used(w, candidate, torch.bfloat16))
    strided = torch.randn(64, 5, generator=g).bfloat16().t()  # rows 64 elements apart, columns 5 apart
    assert_close(lin(strided), strided, weights_used(w, candidate, torch.bfloat16))


PACKED_TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]


@pytest.mark.parametrize("ggml_type", PACKED_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("forced", ["dot", "dot_tiles", "dot_dequant"])
@pytest.mark.parametrize("rows", [1, 3, 6, 16, 17, 33])
def test_packed_candidates_against_the_reference(
    ggml_type: int, forced: str, rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not quant_dot.supports(int(ggml_type)):
        pytest.skip("the bf16 dot-product kernel does not run on this machine")
    if forced == "dot_tiles" and not quant_dot.tiles_usable():
        pytest.skip("no AMX tiles on this machine")
    monkeypatch.setenv(chooser.FORCE_ENV, forced)
    k = 3 * quant_gemm.block_shape(ggml_type)[0]
    w = weight(ggml_type, 37, k, 5)  # 37 columns: the last group of 4 padded
    bias = torch.randn(37, generator=torch.Generator().manual_seed(6)).bfloat16()
    lin = QuantLinear(w, bias, torch.bfloat16)
    # the packed form is all that is held: the file's blocks are let go (K-quants' scales unpacked: < 4% more)
    assert lin.packed is not None and lin.ggml.nbytes == 0
    assert 40 * w.nbytes // 37 <= lin.packed.numel() <= 1.04 * 40 * w.nbytes // 37
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
    used = weights_used(w, "dequant" if forced == "dot_dequant" else "ggml", torch.bfloat16)
    assert_close(lin(x), x, used, bias.float())
    assert lin.tiles_from == (1 if forced == "dot_tiles" else 0)  # in the type code the fused layer takes too
    assert lin.kernel_view()[0] == quant_dot.PACKED + int(ggml_type) + (lin.tiles_from << quant_dot.TILES_SHIFT)
    assert torch.equal(lin.dense_weight(), reference(w).to(torch.bfloat16))
    assert torch.equal(lin.rows(5, 11, torch.float32), reference(w)[5:11])
    # float32 activations after the bf16 choice packed it: its rows dequantized, float32 sums
    x32 = x.float()
    assert lin.choice(torch.float32) == ("dequant",) * len(chooser.ROW_CLASSES)
    assert_close(lin(x32), x32, reference(w), bias.float())


@pytest.mark.parametrize("ggml_type", [T.Q2_K, T.Q3_K], ids=lambda t: t.name)
def test_both_layouts_stay_candidates(ggml_type: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A packed type's bf16 choice is between layouts: the file's blocks ("ggml", "dequant") against the packed
    form ("dot", "dot_dequant", and "dot_tiles" where tiles run); where the blocks win, they stay held."""
    if not quant_dot.supports(int(ggml_type)):
        pytest.skip("the bf16 dot-product kernel does not run on this machine")
    monkeypatch.delenv(chooser.FORCE_ENV, raising=False)
    offered: dict[str, str] = {}

    def blocks_win(
        kind: str, shape: tuple[int, ...], candidates: dict[str, chooser.Bench], form_of: dict[str, str]
    ) -> tuple[str, tuple[str, ...]]:
        offered.update({name: form_of[name] for name in candidates})
        return "blocks", ("ggml",) * len(chooser.ROW_CLASSES)

    monkeypatch.setattr(chooser, "choose_held", blocks_win)
    w = weight(ggml_type, 8, 256, 31)
    lin = QuantLinear(w, None, torch.bfloat16)
    want = {"ggml": "blocks", "dequant": "blocks", "dot": "packed", "dot_dequant": "packed"}
    assert offered == want | ({"dot_tiles": "packed"} if quant_dot.tiles_usable() else {})
    assert lin.packed is None and lin.ggml.data is w.data
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(32)).bfloat16()
    assert_close(lin(x), x, reference(w))


@pytest.mark.parametrize("ggml_type", [T.Q8_0, T.Q6_K], ids=lambda t: t.name)
def test_a_tied_table_reads_the_packed_head(ggml_type: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Gemma's tied Q8_0 table: the head holds it packed, the embedding reads its rows from there (exactly the
    reference's) and keeps no second copy of the blocks."""
    if not quant_dot.supports(int(ggml_type)):
        pytest.skip("the bf16 dot-product kernel does not run on this machine")
    from engine.layers.quant_head import QuantHead, quant_embedding

    monkeypatch.setenv(chooser.FORCE_ENV, "dot")
    w = weight(ggml_type, 50, 2 * quant_gemm.block_shape(ggml_type)[0], 21)
    head = QuantHead(w, torch.bfloat16)
    emb = quant_embedding(w, torch.bfloat16)
    assert emb.source is head.linear and emb.weight is None and emb.nbytes == 0
    ids = torch.tensor([[3, 49, 3], [0, 17, 17]])
    assert torch.equal(emb(ids), reference(w).to(torch.bfloat16)[ids])
    assert torch.equal(emb.dense_weight(), reference(w).to(torch.bfloat16))
    with pytest.raises(IndexError):
        emb(torch.tensor([50]))
    h = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(22)).bfloat16()
    assert_close(head(h).bfloat16(), h, reference(w))  # (logits rounded to bf16, then widened)
    # another weight's table keeps its own blocks
    other = weight(ggml_type, 50, w.shape[1], 23)
    assert quant_embedding(other, torch.bfloat16).weight is other
