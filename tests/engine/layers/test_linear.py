"""Linear objects against F.linear: packed bfloat16 is bitwise equal, split parts are too, the CPU kernel's
within the last bit, int8 within its quantization error; the LM head's forms equal `(h @ W.T).float()`."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from engine.cpu_kernels import gemm
from engine.layers import linear
from engine.layers.linear import (Int8Linear, KernelLinear, Linear, PackedLinear, SplitLinear, cpu_packs_bf16,
                                  make_linear)
from engine.layers.lm_head import LMHead
from engine.layers.parallel import WORKERS

needs_bf16 = pytest.mark.skipif(not cpu_packs_bf16(), reason="this CPU has no native bfloat16 for oneDNN")
needs_kernel = pytest.mark.skipif(not gemm.available(), reason="no AVX512-BF16 CPU kernel here (CPU or compiler)")


def assert_within_last_bit(got: torch.Tensor, want: torch.Tensor) -> None:
    """bf16 results summed in another order than `want`'s: a value may differ by its last bit, rarely."""
    assert got.dtype == want.dtype and got.shape == want.shape
    ulp = torch.finfo(torch.bfloat16).eps * want.float().abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
    assert bool(((got.float() - want.float()).abs() <= ulp * 1.01).all())
    assert float((got != want).float().mean()) < 0.01


@pytest.fixture(autouse=True)
def _one_thread_one_worker() -> Iterator[None]:
    torch.set_num_threads(1)
    yield
    WORKERS.configure(1)


def weights(out: int, inp: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return ((torch.randn(out, inp, generator=g) / inp ** 0.5).to(dtype),
            (0.1 * torch.randn(out, generator=g)).to(dtype))


def test_float32_stays_plain_f_linear() -> None:
    w, b = weights(48, 32, torch.float32)
    lin = make_linear(w, b)
    assert type(lin) is Linear and lin.weight is w
    x = torch.randn(5, 32)
    assert torch.equal(lin(x), F.linear(x, w, b))


def test_bfloat16_on_cpu_takes_the_kernel_where_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    w, b = weights(48, 32, torch.bfloat16)
    assert isinstance(make_linear(w, b), KernelLinear) == gemm.available()
    assert not isinstance(make_linear(weights(48, 31, torch.bfloat16)[0]), KernelLinear)  # odd K: no pairs
    monkeypatch.setattr(gemm, "available", lambda: False)  # no compiler, another CPU, SPINDLE_CPU_KERNELS=0
    assert isinstance(make_linear(w, b), PackedLinear if cpu_packs_bf16() else Linear)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 16, 65])
def test_kernel_linear_is_f_linear_within_the_last_bit(rows: int) -> None:
    w, b = weights(200, 96, torch.bfloat16)
    lin = make_linear(w, b)
    assert isinstance(lin, KernelLinear)
    x = torch.randn(rows, 96).to(torch.bfloat16)
    assert_within_last_bit(lin(x), F.linear(x, w, b))
    assert_within_last_bit(make_linear(w)(x), F.linear(x, w))
    assert torch.equal(lin.dense_weight(), w)
    x3 = torch.randn(2, rows, 96).to(torch.bfloat16)  # leading dims pass through
    assert torch.equal(lin(x3), lin(x3.flatten(0, 1)).view(2, rows, 200))


@needs_bf16
@pytest.mark.parametrize("rows", [1, 3, 16, 65])
def test_packed_bfloat16_is_bitwise_f_linear(rows: int) -> None:
    w, b = weights(200, 96, torch.bfloat16)
    lin = PackedLinear(w, b)
    assert lin.weight.is_mkldnn  # packed once, at build
    x = torch.randn(rows, 96).to(torch.bfloat16)
    assert torch.equal(lin(x), F.linear(x, w, b))
    assert torch.equal(PackedLinear(w)(x), F.linear(x, w))
    assert torch.equal(lin.dense_weight(), w)
    x3 = torch.randn(2, rows, 96).to(torch.bfloat16)  # leading dims pass through
    assert torch.equal(lin(x3), F.linear(x3, w, b))


@needs_bf16
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_split_parts_equal_the_uncut_projection(monkeypatch: pytest.MonkeyPatch, quantization: str | None) -> None:
    """Cut by output rows and shared by two threads, each column is computed as the uncut Linear does."""
    monkeypatch.setattr(linear, "SPLIT_CHUNK_BYTES", 8 << 10)
    monkeypatch.setattr(gemm, "available", lambda: False)  # the kernel shares its work itself: oneDNN's path
    w, b = weights(1000, 64, torch.bfloat16, seed=3)  # 125 KiB: 15 parts of 64-row multiples
    whole = (Int8Linear if quantization else PackedLinear)(w, b)
    WORKERS.configure(2)  # not asked to split: the threads only share the LM head
    assert not isinstance(make_linear(w, b, quantization), SplitLinear)
    WORKERS.configure(2, split_projections=True)
    lin = make_linear(w, b, quantization)
    assert isinstance(lin, SplitLinear) and len(lin.parts) > 4
    assert all((end - start) % 64 == 0 for start, end, _ in lin.parts[:-1])
    assert lin.parts[-1][1] == 1000
    for rows in (1, 7, 33):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        assert torch.equal(lin(x), whole(x))
    assert torch.equal(lin.dense_weight(), whole.dense_weight())
    WORKERS.configure(1, split_projections=True)  # one worker: nothing is cut
    assert not isinstance(make_linear(w, b, quantization), SplitLinear)


def int8_parts(lin: Linear) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [out, in], scale float32 [out]) of an int8 Linear of either form."""
    if isinstance(lin, KernelLinear):
        assert lin.packed.scale is not None
        return lin.packed.dense(), lin.packed.scale
    assert isinstance(lin, Int8Linear)
    return lin.weight, lin.scale.float()


@pytest.mark.parametrize("dtype, kernel", [(torch.float32, False), (torch.bfloat16, False),
                                           pytest.param(torch.bfloat16, True, marks=needs_kernel)])
def test_int8_within_its_quantization_error(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype,
                                            kernel: bool) -> None:
    if not kernel:
        monkeypatch.setattr(gemm, "available", lambda: False)  # ATen's int8 kernel
    w, b = weights(300, 128, dtype, seed=5)
    w[7] = 0  # an all-zero row must not divide by zero
    lin = make_linear(w, b, "int8")
    assert isinstance(lin, KernelLinear if kernel else Int8Linear)
    q, scale = int8_parts(lin)
    assert q.dtype == torch.int8 and q.shape == (300, 128) and scale.shape == (300,)
    # per output channel: every weight within half a step of its row's grid, the row's max on the grid's end;
    # the scale is stored in the activations' dtype, which moves the grid by at most 127 times its rounding
    step = w.float().abs().amax(1) / 127
    err = (q.float() * scale[:, None] - w.float()).abs()
    assert bool((err <= (step * 0.5 * (1 + 1e-6) + 127 * (scale - step).abs())[:, None] + 1e-12).all())
    assert bool((q.abs().amax(1)[step > 0] == 127).all())
    assert torch.equal(lin.dense_weight(), (q.float() * scale[:, None]).to(dtype))
    x = torch.randn(9, 128).to(dtype)
    got, exact = lin(x).double(), F.linear(x.double(), w.double(), b.double())
    # |x . dw| <= sum |x| * step / 2 per output, plus the activations' rounding in bfloat16
    bound = x.double().abs().sum(1, keepdim=True) * step.double()[None, :] / 2
    slack = 1e-5 if dtype == torch.float32 else 2e-2 * exact.abs().max()
    assert bool(((got - exact).abs() <= bound + slack).all())
    assert float((got - exact).abs().max()) > 0  # it is quantized, not the float weight


@needs_kernel
@pytest.mark.parametrize("rows", [1, 16, 40])
def test_int8_kernel_holds_the_weight_aten_int8_holds(monkeypatch: pytest.MonkeyPatch, rows: int) -> None:
    """Same grid, same scales: the two forms differ only in how they sum and round (within a bf16 step)."""
    w, b = weights(200, 96, torch.bfloat16, seed=6)
    lin = make_linear(w, b, "int8")
    assert isinstance(lin, KernelLinear) and lin.packed.nbytes == 208 * 96  # one byte a weight (13 blocks)
    monkeypatch.setattr(gemm, "available", lambda: False)
    aten = make_linear(w, b, "int8")
    assert isinstance(aten, Int8Linear) and torch.equal(lin.dense_weight(), aten.dense_weight())
    (q, scale), (q2, scale2) = int8_parts(lin), int8_parts(aten)
    assert torch.equal(q, q2) and torch.equal(scale, scale2)
    x = torch.randn(rows, 96).to(torch.bfloat16)
    want = x.double() @ q.double().t() * scale.double() + b.double()  # (q * scale in bf16 would round it)
    ulp = torch.finfo(torch.bfloat16).eps * want.abs()
    assert bool(((lin(x).double() - want).abs() <= ulp + 1e-6).all())
    assert bool(((aten(x).double() - want).abs() <= 2 * ulp + 1e-2).all())  # ATen rounds, then adds the bias


def test_unknown_quantization_is_refused() -> None:
    w, _ = weights(8, 8, torch.float32)
    with pytest.raises(ValueError, match="int4"):
        make_linear(w, None, "int4")


@pytest.mark.parametrize("dtype, quantization", [(torch.float32, None), (torch.bfloat16, None),
                                                 (torch.bfloat16, "int8")])
@pytest.mark.parametrize("rows, workers", [(1, 1), (20, 1), (20, 2), (3, 2)])
def test_lm_head_forms_equal_the_plain_product(dtype: torch.dtype, quantization: str | None, rows: int,
                                               workers: int) -> None:
    if dtype == torch.bfloat16 and quantization is None and not cpu_packs_bf16():
        pytest.skip("this CPU has no native bfloat16 for oneDNN")
    vocab = 20_000  # several packed chunks and several transposed column chunks
    w, _ = weights(vocab, 64, dtype, seed=7)
    head = LMHead(w, quantization)
    ref_w = Int8Linear(w).dense_weight() if quantization else w
    h = torch.randn(rows, 64).to(dtype)
    WORKERS.configure(workers)
    out = torch.full((rows, vocab), float("nan"))
    got = head(h, out, WORKERS.pool, WORKERS.n)
    if quantization is None and dtype == torch.bfloat16:  # rounded in the model's dtype, then widened
        assert_within_last_bit(got.bfloat16(), F.linear(h, ref_w))
        assert torch.equal(got, got.bfloat16().float())
        if head.packed is None:
            assert torch.equal(got, F.linear(h, ref_w).float())
    elif quantization is None:  # float32: h @ W.T over the transposed copy sums in another order
        torch.testing.assert_close(got, F.linear(h, ref_w), atol=1e-5, rtol=1e-5)
    else:  # int8 scales the integer product: within bfloat16 rounding of the dequantized product
        torch.testing.assert_close(got, F.linear(h.float(), ref_w.float()), atol=0.05, rtol=0.02)
    assert not bool(got.isnan().any())
    if head.transposed is not None:  # a tied embedding's rows come from the head's columns
        ids = torch.tensor([0, 5, vocab - 1])
        rows_read = head.embedding_rows(ids)
        assert rows_read is not None and torch.equal(rows_read, w[ids])
    else:
        assert head.embedding_rows(torch.tensor([0])) is None
