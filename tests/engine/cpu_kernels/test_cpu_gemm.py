"""engine/cpu_kernels/gemm.py against float64 and torch's bf16 linear: every row-count path (wide tiles for up
to 8 rows, 16-row tiles, k in chunks), tails of columns, bias, float32 out, strided x, threads; weight-only
int8 over the same paths against the float64 product with the dequantized weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.cpu_kernels import gemm, layer_ops

pytestmark = pytest.mark.skipif(not gemm.available(), reason="no AVX512-BF16 CPU kernel here (CPU or compiler)")


def data(m: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(m, k, generator=g).bfloat16(),
        (torch.randn(n, k, generator=g) / k**0.5).bfloat16(),
        torch.randn(n, generator=g).bfloat16(),
    )


def fp32_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """|float32 sum - exact| over k terms, plus one bf16 rounding of the result."""
    mag = x.double().abs() @ w.double().abs().t()
    return mag * x.shape[1] * torch.finfo(torch.float32).eps


# rows: the wide tiles (1-8), 16-row tiles (9-32, block by block), 8-row tiles by 3 blocks past 32; k 1600
# (800 pairs): past 32 rows in two chunks of k whose sums wait between them, up to 32 in one pass
@pytest.mark.parametrize("m", [0, 1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 24, 33, 100])
@pytest.mark.parametrize("n, k", [(40, 64), (17, 96), (1, 32), (300, 1000), (70, 1600)])
def test_equals_the_exact_product_rounded_once(m: int, n: int, k: int) -> None:
    x, w, b = data(m, n, k, seed=m * 1000 + n)
    packed = gemm.PackedWeight(w, b)
    got = packed(x)
    assert torch.equal(packed(x, threads=2), got)  # x re-laid by k (one row tile) or by tile: the same sums
    exact = x.double() @ w.double().t() + b.double()
    half_ulp = exact.abs() * torch.finfo(torch.bfloat16).eps / 2
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    assert bool(((got.double() - exact).abs() <= half_ulp * 1.01 + fp32_bound(x, w)).all())
    want = F.linear(x, w, b)
    assert float((got != want).float().mean()) <= 0.01 if m else True  # torch sums in another order


@pytest.mark.parametrize("k", [64, 1600])  # 1600: 40 rows take the chunked path, 20 two 16-row tiles, 1 the wide one
def test_a_row_is_the_same_whatever_the_batch_around_it(k: int) -> None:
    """Each output sums k in the same order in every path and thread split: batch-invariant, bitwise."""
    x, w, b = data(40, 72, k)
    packed = gemm.PackedWeight(w, b)
    whole = packed(x, threads=2)
    for r in (0, 7, 19, 39):
        assert torch.equal(packed(x[r : r + 1], threads=1)[0], whole[r])
    assert torch.equal(packed(x[3:11], threads=1), whole[3:11])
    assert torch.equal(packed(x[:20], threads=2), whole[:20])
    assert torch.equal(packed(x[7:40], threads=1), whole[7:40])


def test_float32_out_is_the_bf16_product_widened_in_a_wider_buffer() -> None:
    x, w, _ = data(5, 50, 64)
    buf = torch.full((5, 80), float("nan"))
    packed = gemm.PackedWeight(w)
    got = packed(x, out=buf[:, 10:60])
    assert torch.equal(got, packed(x).float())
    assert bool(buf[:, :10].isnan().all()) and bool(buf[:, 60:].isnan().all())  # nothing outside its columns


@pytest.mark.parametrize("m, k", [(2, 512), (40, 64)])  # an LM head's few rows; a prefill's large out
def test_float32_out_of_a_large_product_bypasses_the_caches_and_is_the_same(m: int, k: int) -> None:
    """A product moving 64 MiB or more (weights and float32 out) stores out's full lines around the caches; a
    buffer whose rows do not start on a line takes the plain stores. Both are the bf16 product widened."""
    n = 65_541 if m == 2 else 270_011  # a short last block (masked, plain stores)
    x, w, b = data(m, n, k, seed=k)
    packed = gemm.PackedWeight(w, b)
    assert n * k * 2 + m * n * 4 >= 64 << 20
    want = packed(x, threads=2).float()
    lined = torch.empty(m, (n + 15) // 16 * 16)  # rows on 64-byte lines: streamed
    assert torch.equal(packed(x, threads=2, out=lined[:, :n]), want)
    odd = torch.empty(m, n + 5)  # rows off the lines: plain stores
    assert torch.equal(packed(x, threads=1, out=odd[:, :n]), want)


def test_strided_and_odd_offset_activations() -> None:
    x, w, b = data(6, 24, 64)
    packed = gemm.PackedWeight(w, b)
    wide = torch.zeros(6, 130, dtype=torch.bfloat16)
    wide[:, 2:66] = x  # a strided view: copied first
    assert torch.equal(packed(wide[:, 2:66]), packed(x))
    odd = torch.zeros(6, 131, dtype=torch.bfloat16)
    odd[:, 1:65] = x  # odd stride and offset: copied first
    assert torch.equal(packed(odd[:, 1:65]), packed(x))
    x3 = x.view(2, 3, 64)
    assert torch.equal(packed(x3), packed(x).view(2, 3, 24))


def test_pack_round_trips_and_pads_columns_to_blocks() -> None:
    _, w, _ = data(1, 37, 18)
    packed = gemm.pack(w)
    assert packed.shape == (3, 9, 16, 2)
    assert bool((packed.permute(0, 2, 1, 3).reshape(48, 18)[37:] == 0).all())
    assert torch.equal(gemm.unpack(packed, 37), w)


def test_wrong_shapes_and_dtypes_are_refused() -> None:
    x, w, b = data(3, 32, 64)
    packed = gemm.PackedWeight(w)
    with pytest.raises(TypeError):
        packed(x.float())
    with pytest.raises(TypeError):
        packed(x[:, :32])
    with pytest.raises(ValueError, match="bias"):
        gemm.PackedWeight(w, b.float())
    with pytest.raises(ValueError, match="out"):
        packed(x, out=torch.empty(3, 32, dtype=torch.float16))
    with pytest.raises(ValueError, match="out"):
        packed(x, out=torch.empty(3, 31))
    with pytest.raises(ValueError):
        gemm.PackedWeight(w.float())
    q = torch.zeros(32, 64, dtype=torch.int8)
    with pytest.raises(ValueError):
        gemm.PackedWeight(q)  # int8 needs its scale
    with pytest.raises(ValueError):
        gemm.PackedWeight(w, scale=torch.ones(32))  # a scale needs int8
    with pytest.raises(ValueError, match="scale"):
        gemm.PackedWeight(q, scale=torch.ones(31))
    with pytest.raises(ValueError, match="scale"):
        gemm.PackedWeight(q, scale=torch.ones(32, dtype=torch.bfloat16))
    assert not gemm.usable(torch.zeros(4, 7, dtype=torch.bfloat16))  # odd k
    assert not gemm.usable(torch.zeros(4, 8))  # float32 keeps torch's path


def int8_data(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    q[0, :4] = torch.tensor([-127, 127, -1, 0], dtype=torch.int8)  # the ends of the grid
    scale = torch.rand(n, generator=g) / (127 * k**0.5) + 1e-4
    return torch.randn(m, k, generator=g).bfloat16(), q, scale, torch.randn(n, generator=g).bfloat16()


@pytest.mark.parametrize("m", [0, 1, 2, 5, 8, 9, 16, 17, 33])
@pytest.mark.parametrize("n, k", [(40, 64), (17, 98), (300, 1000)])  # 98: 49 pairs, blocks start mid-line
def test_int8_equals_the_exact_dequantized_product_rounded_once(m: int, n: int, k: int) -> None:
    x, q, scale, b = int8_data(m, n, k, seed=m * 1000 + n)
    packed = gemm.PackedWeight(q, b, scale=scale)
    assert packed.nbytes == -(-n // 16) * 16 * k  # one byte a weight
    got = packed(x, threads=2)
    exact = (x.double() @ q.double().t()) * scale.double() + b.double()
    half_ulp = exact.abs() * torch.finfo(torch.bfloat16).eps / 2
    sums = (x.double().abs() @ q.double().abs().t()) * scale.double() * k * torch.finfo(torch.float32).eps
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    assert bool(((got.double() - exact).abs() <= half_ulp * 1.01 + sums + 1e-30).all())
    assert torch.equal(gemm.PackedWeight(q, scale=scale).dense(), q)
    out = torch.empty(m, n)
    assert torch.equal(packed(x, out=out), got.float())  # float32 out: the same product widened
    if m > 1:  # each row as it is alone, on one thread: bitwise
        assert torch.equal(packed(x[m - 1 :], threads=1)[0], got[m - 1])


def test_int8_streams_half_the_bytes_of_bf16() -> None:
    x, q, scale, _ = int8_data(1, 64, 256, seed=1)
    assert gemm.PackedWeight(q, scale=scale).nbytes * 2 == gemm.PackedWeight(q.bfloat16()).nbytes


# gate|up then SiLU in one call: rows 1-8 (wide tiles), 9-16, 17-32 (two row tiles while their pairs fit in L2:
# k 5600 does not); int8 and bias on the same paths
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 9, 16, 17, 32])
@pytest.mark.parametrize("half, k", [(32, 64), (48, 1000), (160, 200), (32, 5600)])
@pytest.mark.parametrize("int8", [False, True])
def test_gated_product_is_bitwise_the_product_then_silu_mul(m: int, half: int, k: int, int8: bool) -> None:
    if int8:
        x, q, s, b = int8_data(m, 2 * half, k, seed=m + half)
        packed = gemm.PackedWeight(q, b, scale=s)
    else:
        x, w, b = data(m, 2 * half, k, seed=m + half)
        packed = gemm.PackedWeight(w, b)
    for threads in (1, 2):
        got = packed.silu_mul(x, threads)
        if m > 16 and k == 5600:
            assert got is None
            continue
        assert got is not None and got.shape == (m, half)
        assert torch.equal(got, layer_ops.silu_mul(packed(x, threads)))


@pytest.mark.parametrize("m, half", [(33, 32), (4, 40), (0, 32)])  # too many rows; half not whole blocks; none
def test_gated_product_declines_what_it_does_not_take(m: int, half: int) -> None:
    x, w, b = data(m, 2 * half, 64)
    assert gemm.PackedWeight(w, b).silu_mul(x) is None


def test_gated_product_declines_a_prefill_before_copying_or_calling(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(gemm, "_gated_kernel", lambda: lambda *args: calls.append(args[2]) or 1)
    packed = gemm.PackedWeight(*data(1, 64, 64)[1:])
    wide = torch.randn(3, 40, 128).bfloat16()[..., ::2]  # 120 strided rows: a copy if it were taken
    assert packed.silu_mul(wide) is None and packed.silu_mul(wide[0, :33]) is None and not calls
    assert packed.silu_mul(wide[0, :32]) is not None and calls == [32]  # at the limit: called
    with pytest.raises(TypeError):
        packed.silu_mul(wide.float())
