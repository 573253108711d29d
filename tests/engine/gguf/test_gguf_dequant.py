"""GGMLWeight per tensor type against gguf.quants.dequantize (the reference) and transformers' torch dequantizer
(an independent implementation): random blocks, blocks quantized from known floats, blocks from the real files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from engine.gguf.header import SUPPORTED_TYPES, open_mapped, read_header
from engine.gguf.tensor import GGMLWeight, concat_rows, row_bytes
from tests.engine.gguf.files import gemma3_file, smollm2_file

QUANTIZABLE = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1]  # gguf can quantize these
BLOCK_TYPES = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
# the worst error of a round trip through each type, relative to the row's largest magnitude
TOLERANCE = {T.F32: 0.0, T.F16: 1e-3, T.BF16: 8e-3, T.Q8_0: 1e-2, T.Q4_0: 0.15, T.Q4_1: 0.1, T.Q5_0: 0.07, T.Q5_1: 0.05}


def _torch_reference(data: np.ndarray, qtype: T) -> torch.Tensor | None:
    try:
        from transformers.integrations.gguf.dequant import dequantize as torch_dequantize
    except ImportError:
        return None
    try:
        return torch_dequantize(torch.from_numpy(data.copy()), int(qtype), torch.float32)
    except ValueError:  # a type it has no kernel for
        return None


def _weight(qtype: T, blocks: np.ndarray, in_features: int) -> GGMLWeight:
    return GGMLWeight(int(qtype), (blocks.shape[0], in_features), torch.from_numpy(np.ascontiguousarray(blocks)))


def test_the_supported_types_are_the_issues_list() -> None:
    assert {T(t).name for t in SUPPORTED_TYPES} == {"F32", "F16", "BF16", *(t.name for t in BLOCK_TYPES)}


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
def test_quantized_floats_come_back(qtype: T) -> None:
    values = np.random.default_rng(int(qtype)).standard_normal((16, 256)).astype(np.float32)
    blocks = quantize(values, qtype).view(np.uint8).reshape(16, -1)
    weight = _weight(qtype, blocks, 256)
    dense = weight.dequantize(torch.float32)
    assert dense.shape == (16, 256)
    assert torch.equal(dense, torch.from_numpy(dequantize(blocks, qtype).astype(np.float32)))
    scale = np.abs(values).max(axis=1, keepdims=True)
    assert (np.abs(dense.numpy() - values) / scale).max() <= TOLERANCE[qtype]


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_random_blocks_match_both_references(qtype: T) -> None:
    rows, width = 8, 512
    blocks = np.random.default_rng(100 + int(qtype)).integers(
        0, 256, (rows, row_bytes(int(qtype), width)), dtype=np.uint8
    )
    dense = _weight(qtype, blocks, width).dequantize(torch.float32)
    ref = torch.from_numpy(dequantize(blocks, qtype).astype(np.float32))
    assert torch.equal(torch.nan_to_num(dense), torch.nan_to_num(ref))
    other = _torch_reference(blocks, qtype)
    if other is not None:
        torch.testing.assert_close(other.reshape(rows, width), dense, rtol=1e-5, atol=1e-5, equal_nan=True)


def _real_blocks(path: Path) -> dict[int, tuple[str, np.ndarray, int]]:
    """For each type in the file: one 2-D tensor's first 32 rows as blocks, with the row width."""
    mapped = open_mapped(path)
    found: dict[int, tuple[str, np.ndarray, int]] = {}
    for t in read_header(path, mapped).tensors.values():
        if len(t.shape) == 2 and t.ggml_type not in found:
            raw = np.frombuffer(mapped, dtype=np.uint8, count=t.nbytes, offset=t.offset).reshape(t.shape[0], -1)
            found[t.ggml_type] = (t.name, raw[:32].copy(), t.shape[1])
    return found


@pytest.mark.parametrize("file", [smollm2_file, gemma3_file], ids=["smollm2", "gemma3"])
def test_real_blocks_match_both_references(file: object) -> None:
    blocks = _real_blocks(file())  # type: ignore[operator]
    assert blocks
    for qtype, (name, raw, width) in blocks.items():
        dense = _weight(T(qtype), raw, width).dequantize(torch.float32)
        ref = torch.from_numpy(dequantize(raw, T(qtype)).astype(np.float32))
        assert torch.equal(dense, ref), name
        other = _torch_reference(raw, T(qtype))
        if other is not None:
            torch.testing.assert_close(other.reshape(dense.shape), dense, rtol=1e-5, atol=1e-6, msg=name)
        assert torch.isfinite(dense).all() and dense.abs().max() < 100, name


def test_the_real_files_hold_the_types_they_should() -> None:
    assert set(_real_blocks(smollm2_file())) == {T.Q4_1, T.Q8_0}
    assert set(_real_blocks(gemma3_file())) == {T.Q8_0, T.Q5_0, T.Q4_K, T.Q6_K}


def test_concat_rows_fuses_one_type_and_lists_mixed() -> None:
    rng = np.random.default_rng(7)
    parts = [_weight(T.Q8_0, quantize(rng.standard_normal((n, 64)).astype(np.float32), T.Q8_0), 64) for n in (4, 2)]
    fused = concat_rows(parts)
    assert isinstance(fused, GGMLWeight) and fused.shape == (6, 64)
    assert torch.equal(fused.dequantize(torch.float32), torch.cat([p.dequantize(torch.float32) for p in parts]))
    other = _weight(T.Q4_0, quantize(rng.standard_normal((2, 64)).astype(np.float32), T.Q4_0), 64)
    assert concat_rows([parts[0], other]) == [parts[0], other]


def test_a_weight_checks_its_bytes() -> None:
    with pytest.raises(ValueError, match="want"):
        GGMLWeight(int(T.Q8_0), (4, 64), torch.zeros(4, 60, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple of 32"):
        row_bytes(int(T.Q4_0), 48)
