"""A 2-D weight held as the GGUF file's quantized blocks, and the fused-projection concatenation of them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.gguf.header import type_name


def row_bytes(ggml_type: int, in_features: int) -> int:
    """Bytes one row of `in_features` weights takes in this type (a whole number of blocks)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # why late: gguf imports mistral_common (+0.5 s)

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    if in_features % block:
        raise ValueError(f"{type_name(ggml_type)} rows need a multiple of {block} weights, got {in_features}")
    return in_features // block * size


def dequantize_blocks(data: np.ndarray, ggml_type: int, dtype: torch.dtype) -> torch.Tensor:
    """The file's bytes (any shape, last axis the row's bytes) as a float tensor of `dtype`."""
    from gguf import GGMLQuantizationType  # why late: see row_bytes
    from gguf.quants import dequantize as _reference_dequantize

    values = _reference_dequantize(data, GGMLQuantizationType(ggml_type))
    return torch.from_numpy(np.array(values, dtype=np.float32)).to(dtype)  # a copy: the file map is read-only


@dataclass(frozen=True)
class GGMLWeight:
    """A 2-D weight as the file's blocks: `data` uint8 [out_features, row_bytes], rows in torch's [out, in] order
    (any row permutation the loader applies, e.g. llama's Q/K rotary un-permutation, is applied to whole rows)."""

    ggml_type: int  # gguf.GGMLQuantizationType value
    shape: tuple[int, int]  # (out_features, in_features)
    data: torch.Tensor  # uint8, contiguous, [out, row_bytes]

    def __post_init__(self) -> None:
        out_features, in_features = self.shape
        want = (out_features, row_bytes(self.ggml_type, in_features))
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != want:
            raise ValueError(f"GGMLWeight data {tuple(self.data.shape)} {self.data.dtype}, want {want} uint8")

    @property
    def nbytes(self) -> int:
        return int(self.data.numel())

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The dense [out, in] weight in `dtype` (gguf.quants.dequantize is the reference)."""
        dense = dequantize_blocks(self.data.numpy(), self.ggml_type, torch.float32)
        return dense.reshape(self.shape).to(dtype)


def concat_rows(parts: Sequence[GGMLWeight]) -> GGMLWeight | list[GGMLWeight]:
    """Fused q|k|v or gate|up: one weight when the types and input widths agree, else the parts as a list."""
    if not parts:
        raise ValueError("concat_rows needs at least one part")
    first = parts[0]
    if any(p.ggml_type != first.ggml_type or p.shape[1] != first.shape[1] for p in parts):
        return list(parts)
    rows = sum(p.shape[0] for p in parts)
    data = torch.cat([p.data for p in parts], dim=0).contiguous()
    return GGMLWeight(first.ggml_type, (rows, first.shape[1]), data)
