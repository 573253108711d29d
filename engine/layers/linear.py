"""Linear projections as objects built once at load: `lin = make_linear(w, b, quantization); y = lin(x)`.

Models call these instead of `F.linear` on raw weights, so each weight is held in the form fastest on its
device, chosen once at load, with no re-layout or dtype conversion per step:
- bfloat16 on a CPU with AVX512-BF16: engine/cpu_kernels' gemm with the weight packed for it
  (`KernelLinear`). On a decode step's few rows it streams the weights at close to the memory's rate, where
  oneDNN reaches about half of it (bench/README.md, "The bf16 GEMM kernel against oneDNN"); sums are float32
  rounded once, as torch's, and equal them but for the last bit of a few values in ten thousand (the order of
  the sums differs).
- bfloat16 on a CPU with native bf16 but no kernel (no compiler, AMX only, SPINDLE_CPU_KERNELS=0): oneDNN with
  the weight pre-packed into its blocked layout (`PackedLinear`). Plain `F.linear` re-lays the weight out on
  every call, and a decode step's projections took about twice the CPU time that way; bitwise F.linear.
- quantization "int8": weight-only int8, one symmetric scale per output channel, activations stay in the
  model's dtype: through the same kernel where it runs (`KernelLinear`, the int8 weight packed the same way:
  half the bytes to stream), else ATen's `_weight_int8pack_mm` (`Int8Linear`).
- anything else (GPU, float32): `F.linear` on the weight as loaded.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from engine.cpu_kernels import gemm
from engine.layers.parallel import WORKERS

QUANTIZATIONS = ("int8",)
# GGUF weights kept as their blocks: engine/layers/quant_linear.py adds its maker here when imported (it imports
# this module, so this one cannot import it)
QUANTIZED_MAKERS: list[Callable[[Any, torch.Tensor | None], Linear]] = []
SPLIT_CHUNK_BYTES = 4 << 20  # CPU: weights of at least twice this are cut into chunks of about this size


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
    quantization "int8") packed once for it."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, quantization: str | None = None) -> None:
        super().__init__(weight, bias)
        self.packed = packed_weight(weight, bias, quantization)
        del self.weight  # the packed copy is the only one kept
        self._macs_per_row, self._bytes = self.out_features * self.in_features, self.packed.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.packed(x, self._threads(x))

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """For a gate|up weight: silu(gate) * up of self(x) in one call, rounded as the two steps are; None
        where the kernel declines (more rows than a decode step's): then call self(x) and layer_ops.silu_mul."""
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
        self.parts = [(s, min(s + rows, self.out_features),
                       make(weight[s:s + rows], None if bias is None else bias[s:s + rows]))
                      for s in range(0, self.out_features, rows)]
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


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None = None, quantization: str | None = None) -> Linear:
    """The fastest Linear for this weight [out, in] on its device; quantization None keeps the weight's dtype."""
    if not isinstance(weight, torch.Tensor) and QUANTIZED_MAKERS:  # a GGMLWeight (or fused parts): stays quantized
        return QUANTIZED_MAKERS[-1](weight, bias)
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r} is not supported; supported: {', '.join(QUANTIZATIONS)}")
    if quantization is not None and weight.device.type != "cpu":
        raise ValueError(f"--quantization {quantization} runs on CPU only")  # ATen's int8 kernel is CPU-only here
    make: type[Linear] = Linear
    if gemm.usable(weight):
        return KernelLinear(weight, bias, quantization)  # the kernel shares its work over the step's threads itself
    if quantization == "int8":
        make = Int8Linear
    elif weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and cpu_packs_bf16():
        make = PackedLinear
    big = weight.numel() * weight.element_size() >= 2 * SPLIT_CHUNK_BYTES
    if make is not Linear and WORKERS.n > 1 and WORKERS.split_projections and big:
        parts = max(2 * WORKERS.n, weight.numel() * weight.element_size() // SPLIT_CHUNK_BYTES)
        return SplitLinear(weight, bias, make, parts)
    return make(weight, bias)
