"""Linear projections as objects built once at load: `lin = make_linear(w, b, quantization); y = lin(x)`.

Models call these instead of `F.linear` on raw weights, so each weight is held in the form fastest on its
device, chosen once at load, with no re-layout or dtype conversion per step. On CPU the form is chosen by
measurement (engine/cpu_kernels/chooser.py), per shape and row-count class, among the candidates that apply:
- "spindle": engine/cpu_kernels' gemm, the weight (bf16, or int8 with quantization "int8") packed for it
  (`KernelLinear`). Where it wins, a decode step's few rows stream the weights at close to the memory's rate;
  sums are float32 rounded once, as torch's. From the same layout, "spindle-unpack" runs many rows through
  torch's GEMM on output tiles unpacked one at a time (no second copy of the weight).
- "onednn": bfloat16 through oneDNN, the weight pre-packed into its blocked layout once (`PackedLinear`; AMX
  tiles where the CPU has them). Plain `F.linear` re-lays the weight out on every call; bitwise F.linear.
- "amx": bfloat16 through AMX tiles of our own (`AmxLinear`, engine/cpu_kernels/gemm_amx.py), where the CPU and
  Linux give tiles: one straight stream of packed tiles per thread.
- "int8pack": weight-only int8, one symmetric scale per output channel, through ATen's `_weight_int8pack_mm`
  (`Int8Linear`).
- "torch": `F.linear` on the weight as loaded (GPU, float32, and where nothing else runs).
One layout is held per weight: where the winners need two, the one that loses least over all row classes is kept
and the classes are chosen again among its candidates (chooser.choose_held).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from engine.cpu_kernels import chooser, gemm, gemm_amx
from engine.layers.parallel import WORKERS

QUANTIZATIONS = ("int8",)
# GGUF weights kept as their blocks: engine/layers/quant_linear.py adds its maker here when imported (it imports
# this module, so this one cannot import it)
QUANTIZED_MAKERS: list[Callable[[Any, torch.Tensor | None], Linear]] = []
SPLIT_CHUNK_BYTES = 4 << 20  # CPU: weights of at least twice this are cut into chunks of about this size
UNPACK_COLS = 1024  # "spindle-unpack": output columns unpacked per tile (a tile of 1024 x 4864 bf16: 10 MiB)


class Linear:
    """y = x @ weight.T + bias, weight [out, in] in the model's dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight
        self.bias = bias
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def dense_weight(self) -> torch.Tensor:
        """The weight as [out, in] in the model's dtype (for tests and tools; may allocate)."""
        return self.weight


class PackedLinear(Linear):
    """bfloat16 on CPU through oneDNN, the weight reordered once into oneDNN's blocked layout."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__(weight, bias)
        # no batch size given: one layout serves every row count (a per-size layout measured no faster)
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return y

    def dense_weight(self) -> torch.Tensor:
        return self.weight.to_dense()


class AmxLinear(Linear):
    """bfloat16 on CPU through AMX tiles of our own (engine/cpu_kernels/gemm_amx.py), the weight packed once."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__(weight, bias)
        self.weight = gemm_amx.pack(weight)  # flat: only dense_weight() gives [out, in] back
        self.bias = None if bias is None else bias.to(torch.bfloat16).contiguous()
        self._macs, self._bytes = self.out_features * self.in_features, 2 * self.out_features * self.in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        threads = WORKERS.threads_for(x2.shape[0] * self._macs, self._bytes)
        y = gemm_amx.matmul(x2, self.weight, self.out_features, self.bias, threads)
        return y.view(*x.shape[:-1], self.out_features)

    def runs_kernel(self, rows: int) -> bool:
        """Always (engine/models/fused_decode.py asks): the chooser held this layout for its only candidate."""
        return True

    def dense_weight(self) -> torch.Tensor:
        return gemm_amx.unpack(self.weight, self.out_features, self.in_features)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (q int8 [out, in], scale float32 [out]), symmetric per output channel: w ~ q * scale."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    return (w / scale[:, None]).round_().clamp_(-127, 127).to(torch.int8).contiguous(), scale


def packed_weight(weight: torch.Tensor, bias: torch.Tensor | None, quantization: str | None) -> gemm.PackedWeight:
    """weight [out, in] bf16 (gemm.usable) packed for the kernel, as is or weight-only int8; an int8 scale is
    rounded to bf16 first, so the weight is the one Int8Linear holds."""
    if quantization is None:
        return gemm.PackedWeight(weight, bias)
    q, scale = quantize_int8(weight)
    return gemm.PackedWeight(q, bias, scale=scale.to(weight.dtype).float())


class KernelLinear(Linear):
    """bfloat16 activations on CPU through engine/cpu_kernels/gemm.py, the weight (bf16, or int8 with
    quantization "int8") packed once for it. `winners`: per row class (chooser.ROW_CLASSES), "spindle" or
    "spindle-unpack" (those rows through torch's GEMM, output tiles unpacked from the same layout)."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        quantization: str | None = None,
        winners: tuple[str, ...] | None = None,
    ) -> None:
        super().__init__(weight, bias)
        self.packed = packed_weight(weight, bias, quantization)
        del self.weight  # the packed copy is the only one kept
        self._macs_per_row, self._bytes = self.out_features * self.in_features, self.packed.nbytes
        self.set_winners(winners or ("spindle",) * len(chooser.ROW_CLASSES))

    def set_winners(self, winners: tuple[str, ...]) -> None:
        """The path per row class: "spindle" or "spindle-unpack" (the chooser's decision)."""
        self.winners = winners
        # the smallest row count that goes through torch's GEMM (none: 1 << 62)
        self._unpack_from = min(
            (lo for (lo, _), w in zip(chooser.ROW_CLASSES, winners) if w == "spindle-unpack"), default=1 << 62
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows >= self._unpack_from and self.runs_unpacked(rows):
            return self.unpacked(x)
        return self.packed(x, self._threads(x))

    def runs_kernel(self, rows: int) -> bool:
        """Whether a call of `rows` rows runs the kernel itself (engine/models/fused_decode.py asks)."""
        return self.winners[chooser.row_class(rows)] == "spindle"

    def runs_unpacked(self, rows: int) -> bool:
        return self.winners[chooser.row_class(rows)] == "spindle-unpack"

    def unpacked(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T + b through torch's GEMM, the weight unpacked a tile of output columns at a time."""
        p = self.packed
        x2 = x.reshape(-1, self.in_features)
        out = torch.empty(x2.shape[0], self.out_features, dtype=torch.bfloat16)
        blocks = UNPACK_COLS // gemm.BLOCK
        for b in range(0, p.packed.shape[0], blocks):
            start = b * gemm.BLOCK
            end = min(start + UNPACK_COLS, self.out_features)
            tile = p.packed[b : b + blocks].permute(0, 2, 1, 3).reshape(-1, self.in_features)[: end - start]
            if p.scale is not None:
                tile = (tile.float() * p.scale[start:end, None]).to(torch.bfloat16)
            bias = None if p.bias is None else p.bias[start:end]
            out[:, start:end] = F.linear(x2, tile, bias)
        return out.view(*x.shape[:-1], self.out_features)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """For a gate|up weight: silu(gate) * up of self(x) in one call, rounded as the two steps are; None
        where the kernel declines (more rows than a decode step's): then call self(x) and layer_ops.silu_mul."""
        if not self.runs_kernel(x.numel() // self.in_features):
            return None
        return self.packed.silu_mul(x, self._threads(x))

    def _threads(self, x: torch.Tensor) -> int:
        rows = x.numel() // self.in_features
        return WORKERS.threads_for(rows * self._macs_per_row, self._bytes)

    def dense_weight(self) -> torch.Tensor:
        w, scale = self.packed.dense(), self.packed.scale
        return w if scale is None else (w.float() * scale[:, None]).to(torch.bfloat16)


class Int8Linear(Linear):
    """Weight-only int8: w ~ q * scale, q int8 [out, in], scale [out] (symmetric, per output channel)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__(weight, bias)
        self.weight, scale = quantize_int8(weight)
        self.scale = scale.to(weight.dtype)  # the kernel takes scales in the activations' dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y: torch.Tensor = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, shape[-1]), self.weight, self.scale)
        if self.bias is not None:
            y += self.bias
        return y.view(*shape[:-1], self.out_features)

    def dense_weight(self) -> torch.Tensor:
        return (self.weight.float() * self.scale.float()[:, None]).to(self.scale.dtype)


class SplitLinear(Linear):
    """A CPU weight cut by output rows into parts (each packed or quantized on its own), which the
    threads of engine/layers/parallel.py take as they come free. Each output column is computed exactly as
    the uncut Linear computes it."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, make: type[Linear], parts: int) -> None:
        super().__init__(weight, bias)
        rows = (-(-self.out_features // parts) + 63) // 64 * 64  # oneDNN blocks output rows by up to 64
        self.parts = [
            (
                s,
                min(s + rows, self.out_features),
                make(weight[s : s + rows], None if bias is None else bias[s : s + rows]),
            )
            for s in range(0, self.out_features, rows)
        ]
        self.dtype = weight.dtype
        del self.weight  # the parts hold it

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        out = torch.empty(x2.shape[0], self.out_features, dtype=self.dtype, device=x.device)
        parts = iter(self.parts)

        def work() -> None:
            for start, end, lin in parts:
                out[:, start:end].copy_(lin(x2))

        WORKERS.run(work)
        return out.view(*x.shape[:-1], self.out_features)

    def dense_weight(self) -> torch.Tensor:
        return torch.cat([lin.dense_weight() for _, _, lin in self.parts])


@functools.cache
def cpu_packs_bf16() -> bool:
    """Whether oneDNN runs bfloat16 natively on this CPU (otherwise it emulates, and packing buys nothing)."""
    return bool(torch._C._has_mkldnn and torch.ops.mkldnn._is_mkldnn_bf16_supported())


FORM_OF = {
    "spindle": "spindle",
    "spindle-unpack": "spindle",
    "onednn": "onednn",
    "amx": "amx",
    "int8pack": "int8pack",
    "torch": "torch",
}


def candidate_forms(
    weight: torch.Tensor, bias: torch.Tensor | None, quantization: str | None
) -> dict[str, Callable[[], Linear]]:
    """The layouts this CPU weight can be held in, each as what builds its Linear (candidate names of
    chooser.py: the layout's first candidate)."""
    forms: dict[str, Callable[[], Linear]] = {}
    if gemm.usable(weight) if quantization is None else weight.dtype == torch.bfloat16 and gemm.usable(weight):
        forms["spindle"] = lambda: KernelLinear(weight, bias, quantization)
    if quantization == "int8":
        forms["int8pack"] = lambda: Int8Linear(weight, bias)
    elif weight.dtype == torch.bfloat16 and cpu_packs_bf16():
        forms["onednn"] = lambda: PackedLinear(weight, bias)
    if quantization is None and gemm_amx.takes(weight):
        forms["amx"] = lambda: AmxLinear(weight, bias)
    if quantization is None:
        forms["torch"] = lambda: Linear(weight, bias)
    return forms


def _bench(lin: Linear, name: str) -> chooser.Bench:
    """rows -> one call of `lin` on that many rows, run on the threads a step of that many rows gets (a one-row
    step's torch ops run on one thread: engine/execution/model_runner.py)."""

    def at(rows: int) -> Callable[[], object]:
        x = torch.randn(rows, lin.in_features, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        if isinstance(lin, KernelLinear) and name == "spindle-unpack":
            return lambda: lin.unpacked(x)
        threads = 1 if rows == 1 and not isinstance(lin, (KernelLinear, AmxLinear)) else torch.get_num_threads()

        def call() -> object:
            before = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                with torch.inference_mode():
                    return lin(x)
            finally:
                torch.set_num_threads(before)

        return call

    return at


def choose_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, quantization: str | None, kind: str = "linear"
) -> tuple[Linear, tuple[str, ...]]:
    """The CPU Linear of the layout the chooser keeps for this weight, and its winner per row class."""
    forms = candidate_forms(weight, bias, quantization)
    built: dict[str, Linear] = {}

    def bench(name: str) -> chooser.Bench:
        def at(rows: int) -> Callable[[], object]:
            form = FORM_OF[name]
            if form not in built:
                built[form] = forms[form]()
            return _bench(built[form], name)(rows)

        return at

    names = [n for n in FORM_OF if FORM_OF[n] in forms]
    kind = f"{kind}-{quantization or str(weight.dtype).removeprefix('torch.')}"
    held, winners = chooser.choose_held(kind, tuple(weight.shape), {n: bench(n) for n in names}, FORM_OF)
    lin = built.get(held) or forms[held]()
    if isinstance(lin, KernelLinear):
        lin.set_winners(winners)
    return lin, winners


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None = None, quantization: str | None = None) -> Linear:
    """The fastest Linear for this weight [out, in] on its device; quantization None keeps the weight's dtype."""
    if not isinstance(weight, torch.Tensor) and QUANTIZED_MAKERS:  # a GGMLWeight (or fused parts): stays quantized
        return QUANTIZED_MAKERS[-1](weight, bias)
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r} is not supported; supported: {', '.join(QUANTIZATIONS)}")
    if quantization is not None and weight.device.type != "cpu":
        raise ValueError(f"--quantization {quantization} runs on CPU only")  # ATen's int8 kernel is CPU-only here
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return Int8Linear(weight, bias) if quantization == "int8" else Linear(weight, bias)
    try:
        lin, _ = choose_linear(weight, bias, quantization)
    except chooser.ChooserError:
        return Int8Linear(weight, bias) if quantization == "int8" else Linear(weight, bias)
    big = weight.numel() * weight.element_size() >= 2 * SPLIT_CHUNK_BYTES
    make = type(lin)
    if make in (PackedLinear, Int8Linear) and WORKERS.n > 1 and WORKERS.split_projections and big:
        parts = max(2 * WORKERS.n, weight.numel() * weight.element_size() // SPLIT_CHUNK_BYTES)
        return SplitLinear(weight, bias, make, parts)
    return lin
