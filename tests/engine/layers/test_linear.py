"""Linear objects against F.linear: packed bfloat16 is bitwise equal, split parts are too, the CPU kernel's
within a bf16 ulp of the exact product, int8 within its quantization error; the chooser's decision is the form
held and the path each row count takes; the LM head's forms equal `(h @ W.T).float()`."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from engine.cpu_kernels import chooser, gemm, gemm_amx
from engine.layers import linear
from engine.layers.linear import (
    Int8Linear,
    KernelLinear,
    Linear,
    PackedLinear,
    SplitLinear,
    cpu_packs_bf16,
    make_linear,
)
from engine.layers.lm_head import LMHead, choose_head, head_forms
from engine.layers.parallel import WORKERS

needs_bf16 = pytest.mark.skipif(not cpu_packs_bf16(), reason="this CPU has no native bfloat16 for oneDNN")
needs_kernel = pytest.mark.skipif(not gemm.available(), reason="no AVX512-BF16 CPU kernel here (CPU or compiler)")


def assert_within_an_ulp(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> None:
    """bf16 `got` within one bf16 ulp of the exact product x @ w.T + b of the same bf16 inputs: each path (oneDNN,
    AMX tiles, our kernel) sums in float32 in its own order and rounds once, so each is within an ulp of the
    exact value, though not always within one of each other. The float32 sums' own error is the slack."""
    exact = x.double() @ w.double().t() + (0 if b is None else b.double())
    assert got.dtype == torch.bfloat16 and got.shape == exact.shape
    ulp = torch.finfo(torch.bfloat16).eps * exact.abs()
    sums = x.double().abs() @ w.double().abs().t() * x.shape[-1] * torch.finfo(torch.float32).eps
    assert bool(((got.double() - exact).abs() <= ulp + sums + 1e-30).all())


def rand(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def force(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """The chooser takes `name` wherever it is a candidate, timing nothing."""
    monkeypatch.setenv(chooser.FORCE_ENV, name)
    chooser.forget()


@pytest.fixture(autouse=True)
def _one_thread_one_worker() -> Iterator[None]:
    torch.set_num_threads(1)
    yield
    WORKERS.configure(1)


def weights(out: int, inp: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return ((torch.randn(out, inp, generator=g) / inp**0.5).to(dtype), (0.1 * torch.randn(out, generator=g)).to(dtype))


def test_float32_stays_plain_f_linear() -> None:
    w, b = weights(48, 32, torch.float32)
    lin = make_linear(w, b)
    assert type(lin) is Linear and lin.weight is w
    x = torch.randn(5, 32)
    assert torch.equal(lin(x), F.linear(x, w, b))


@pytest.mark.parametrize("name, form", [("spindle", KernelLinear), ("onednn", PackedLinear), ("torch", Linear)])
def test_bfloat16_on_cpu_holds_the_chosen_form(monkeypatch: pytest.MonkeyPatch, name: str, form: type[Linear]) -> None:
    w, b = weights(48, 32, torch.bfloat16)
    force(monkeypatch, name)
    present = {"spindle": gemm.available(), "onednn": cpu_packs_bf16(), "torch": True}[name]
    if not present:
        pytest.skip(f"{name} does not run on this machine")
    assert type(make_linear(w, b)) is form
    assert not isinstance(make_linear(weights(48, 31, torch.bfloat16)[0]), KernelLinear)  # odd K: no pairs


def fake_choice(monkeypatch: pytest.MonkeyPatch, winners: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The chooser answers `winners` for the full candidate set, and the held layout's first candidate per class
    when asked again among fewer; returns the candidate sets it was asked about."""
    asked: list[tuple[str, ...]] = []

    def choose(kind: str, shape: tuple[int, ...], candidates: dict[str, chooser.Bench]) -> tuple[tuple[str, ...], bool]:
        asked.append(tuple(candidates))
        return tuple(w if w in candidates else next(iter(candidates)) for w in winners), True

    monkeypatch.setattr(chooser, "_choose", choose)
    return asked


@needs_kernel
@needs_bf16
def test_one_layout_is_held_and_each_row_class_takes_its_winner(monkeypatch: pytest.MonkeyPatch) -> None:
    w, b = weights(200, 96, torch.bfloat16)
    asked = fake_choice(monkeypatch, ("spindle", "spindle", "spindle-unpack", "spindle-unpack", "onednn"))
    lin = make_linear(w, b)  # "spindle"'s layout wins four classes of five: held, and chosen again among its own
    amx = ("amx",) if gemm_amx.takes(w) else ()  # AMX tiles of our own: a candidate where the CPU has them
    assert type(lin) is KernelLinear and asked == [
        ("spindle", "spindle-unpack", "onednn", *amx, "torch"),
        ("spindle", "spindle-unpack"),
    ]
    # asked again among the held layout's own, the prefill class takes its first candidate (fake_choice)
    assert isinstance(lin, KernelLinear) and lin.winners == ("spindle",) * 2 + ("spindle-unpack",) * 2 + ("spindle",)
    unpacked = monkeypatch_calls(monkeypatch, lin)
    for rows in (1, 4, 5, 64, 65):
        x = rand(rows, 96, seed=rows)
        assert_within_an_ulp(lin(x), x, w, b)
    assert unpacked == [5, 64] and lin.runs_kernel(4) and not lin.runs_kernel(5) and lin.runs_kernel(65)
    assert lin.silu_mul(rand(20, 96)) is None  # the gated call is the kernel's: those rows go the other way
    fake_choice(monkeypatch, ("onednn", "onednn", "spindle", "onednn", "onednn"))
    assert type(make_linear(w, b)) is PackedLinear


def monkeypatch_calls(monkeypatch: pytest.MonkeyPatch, lin: KernelLinear) -> list[int]:
    """The row counts of every call that goes through torch's GEMM on unpacked tiles."""
    calls: list[int] = []
    real = lin.unpacked

    def counted(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.numel() // lin.in_features)
        return real(x)

    monkeypatch.setattr(lin, "unpacked", counted)
    return calls


@needs_kernel
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_unpacked_tiles_equal_the_kernel_within_an_ulp(quantization: str | None) -> None:
    w, b = weights(1100, 64, torch.bfloat16, seed=2)  # two tiles of UNPACK_COLS, the second partial
    lin = KernelLinear(w, b, quantization)
    x = rand(70, 64, seed=3)
    dense = lin.dense_weight()
    if quantization is None:
        assert_within_an_ulp(lin.unpacked(x), x, dense, b)
    else:  # the tile is dequantized to bf16 first: within that rounding of the kernel's product
        torch.testing.assert_close(lin.unpacked(x), lin(x), atol=0.02, rtol=0.02)


def test_the_chooser_failing_falls_back_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object) -> tuple[tuple[str, ...], bool]:
        raise chooser.ChooserError("nothing ran")

    monkeypatch.setattr(chooser, "_choose", fail)
    w, b = weights(48, 32, torch.bfloat16)
    assert type(make_linear(w, b)) is Linear and type(make_linear(w, b, "int8")) is Int8Linear


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 16, 65])
def test_kernel_linear_is_within_an_ulp_of_the_exact_product(monkeypatch: pytest.MonkeyPatch, rows: int) -> None:
    w, b = weights(200, 96, torch.bfloat16)
    force(monkeypatch, "spindle")
    lin = make_linear(w, b)
    assert isinstance(lin, KernelLinear)
    x = rand(rows, 96, seed=rows)
    assert_within_an_ulp(lin(x), x, w, b)
    assert_within_an_ulp(make_linear(w)(x), x, w)
    assert_within_an_ulp(F.linear(x, w, b), x, w, b)  # torch's own path (oneDNN, AMX tiles) is held to the same
    assert torch.equal(lin.dense_weight(), w)
    x3 = rand(2, rows, 96, seed=rows + 100)  # leading dims pass through
    assert torch.equal(lin(x3), lin(x3.flatten(0, 1)).view(2, rows, 200))


@needs_bf16
@pytest.mark.parametrize("rows", [1, 3, 16, 65])
def test_packed_bfloat16_is_bitwise_f_linear(rows: int) -> None:
    w, b = weights(200, 96, torch.bfloat16)
    lin = PackedLinear(w, b)
    assert lin.weight.is_mkldnn  # packed once, at build
    x = rand(rows, 96, seed=rows)
    assert torch.equal(lin(x), F.linear(x, w, b))
    assert torch.equal(PackedLinear(w)(x), F.linear(x, w))
    assert torch.equal(lin.dense_weight(), w)
    x3 = rand(2, rows, 96, seed=rows + 100)  # leading dims pass through
    assert torch.equal(lin(x3), F.linear(x3, w, b))


@needs_bf16
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_split_parts_equal_the_uncut_projection(monkeypatch: pytest.MonkeyPatch, quantization: str | None) -> None:
    """Cut by output rows and shared by two threads, each column is computed as the uncut Linear does."""
    monkeypatch.setattr(linear, "SPLIT_CHUNK_BYTES", 8 << 10)
    force(monkeypatch, "int8pack" if quantization else "onednn")  # the kernel shares its work itself
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
        x = rand(rows, 64, seed=rows)
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


@pytest.mark.parametrize(
    "dtype, kernel",
    [(torch.float32, False), (torch.bfloat16, False), pytest.param(torch.bfloat16, True, marks=needs_kernel)],
)
def test_int8_within_its_quantization_error(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, kernel: bool) -> None:
    force(monkeypatch, "spindle" if kernel else "int8pack")
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
    x = rand(9, 128, seed=9).to(dtype)
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
    force(monkeypatch, "spindle")
    lin = make_linear(w, b, "int8")
    assert isinstance(lin, KernelLinear) and lin.packed.nbytes == 208 * 96  # one byte a weight (13 blocks)
    force(monkeypatch, "int8pack")
    aten = make_linear(w, b, "int8")
    assert isinstance(aten, Int8Linear) and torch.equal(lin.dense_weight(), aten.dense_weight())
    (q, scale), (q2, scale2) = int8_parts(lin), int8_parts(aten)
    assert torch.equal(q, q2) and torch.equal(scale, scale2)
    x = rand(rows, 96, seed=rows)
    want = x.double() @ q.double().t() * scale.double() + b.double()  # (q * scale in bf16 would round it)
    ulp = torch.finfo(torch.bfloat16).eps * want.abs()
    assert bool(((lin(x).double() - want).abs() <= ulp + 1e-6).all())
    assert bool(((aten(x).double() - want).abs() <= 2 * ulp + 1e-2).all())  # ATen rounds, then adds the bias


def test_unknown_quantization_is_refused() -> None:
    w, _ = weights(8, 8, torch.float32)
    with pytest.raises(ValueError, match="int4"):
        make_linear(w, None, "int4")


@pytest.mark.parametrize(
    "dtype, quantization", [(torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, "int8")]
)
@pytest.mark.parametrize("rows, workers", [(1, 1), (20, 1), (20, 2), (3, 2)])
def test_lm_head_forms_equal_the_plain_product(
    dtype: torch.dtype, quantization: str | None, rows: int, workers: int
) -> None:
    vocab = 20_000  # several packed chunks and several transposed column chunks
    w, _ = weights(vocab, 64, dtype, seed=7)
    ref_w = Int8Linear(w).dense_weight() if quantization else w
    h = rand(rows, 64, seed=rows).to(dtype)
    WORKERS.configure(workers)
    for form in head_forms(w, quantization):  # every form this machine can hold
        head = LMHead(w, quantization, form=form)
        out = torch.full((rows, vocab), float("nan"))
        got = head(h, out, WORKERS.pool, WORKERS.n)
        if quantization is None and dtype == torch.bfloat16:  # rounded in the model's dtype, then widened
            assert_within_an_ulp(got.bfloat16(), h, ref_w)
            assert torch.equal(got, got.bfloat16().float())
            if form == "onednn":
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


def test_the_head_holds_the_form_the_chooser_keeps(monkeypatch: pytest.MonkeyPatch) -> None:
    w, _ = weights(3000, 64, torch.bfloat16, seed=8)
    forms = head_forms(w, None)
    fake_choice(monkeypatch, (forms[-1],) * 3 + (forms[0],) * 2)  # the last form wins three classes of five
    assert choose_head(w, None).form == forms[-1] == "torch"
    assert choose_head(w.float(), None).form == "torch"  # one form: nothing to choose
