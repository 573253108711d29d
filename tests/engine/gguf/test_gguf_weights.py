"""GGUF tensors by Hugging Face name (engine/models/gguf_weights.py): the name table, llama's Q/K row order, Gemma's
norm offset, MoE experts sliced from their stacked tensor, and quantized weights kept as the file's blocks."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from engine.gguf.tensor import GGMLWeight
from engine.models.checkpoint_meta import ModelLoadError
from engine.models.gguf_layouts import rotary_rows
from engine.models.gguf_weights import GGUFWeights
from tests.engine.gguf.files import HEADS, KV_HEADS, write_llama

CPU = torch.device("cpu")


def _llama_reverse_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """transformers' LlamaTensorProcessor._reverse_permute_weights, written out."""
    dim = w.shape[0] // heads // 2
    return w.reshape(heads, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def test_rotary_rows_undo_llama_cpps_permutation() -> None:
    w = np.random.default_rng(0).standard_normal((8 * 32, 5))
    assert np.array_equal(w[rotary_rows(256, 8).numpy()], _llama_reverse_permute(w, 8))


@pytest.fixture
def llama(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    path = tmp_path / "llama.gguf"
    return path, write_llama(path, tied=False)


def test_names_map_and_q_k_rows_are_restored(llama: tuple[Path, dict[str, np.ndarray]]) -> None:
    path, tensors = llama
    w = GGUFWeights([path], torch.float32, CPU)
    q, k = w("model.layers.1.self_attn.q_proj.weight"), w("model.layers.1.self_attn.k_proj.weight")
    assert np.array_equal(q.numpy(), _llama_reverse_permute(tensors["blk.1.attn_q.weight"], HEADS))
    assert np.array_equal(k.numpy(), _llama_reverse_permute(tensors["blk.1.attn_k.weight"], KV_HEADS))
    assert not np.array_equal(q.numpy(), tensors["blk.1.attn_q.weight"])
    assert np.array_equal(w("model.layers.0.mlp.down_proj.weight").numpy(), tensors["blk.0.ffn_down.weight"])
    assert np.array_equal(w("lm_head.weight").numpy(), tensors["output.weight"])
    assert np.array_equal(w("model.norm.weight").numpy(), tensors["output_norm.weight"])
    assert "model.layers.0.self_attn.q_proj.bias" not in w and "model.layers.5.mlp.up_proj.weight" not in w
    with pytest.raises(ModelLoadError, match="'model.layers.0.self_attn.q_proj.bias' has no tensor"):
        w("model.layers.0.self_attn.q_proj.bias")


def test_quantized_weights_kept_as_blocks_hold_the_restored_rows(tmp_path: Path) -> None:
    path = tmp_path / "q8.gguf"
    write_llama(path, qtype=T.Q8_0)
    dense = GGUFWeights([path], torch.float32, CPU)
    kept = GGUFWeights([path], torch.float32, CPU, keep_quantized=True)
    for name in (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.1.mlp.gate_proj.weight",
    ):
        blocks = kept(name)
        assert isinstance(blocks, GGMLWeight) and blocks.ggml_type == T.Q8_0
        assert torch.equal(blocks.dequantize(torch.float32), dense(name))
    assert isinstance(kept("model.layers.0.input_layernorm.weight"), torch.Tensor)  # norms: dense
    assert kept.held_bytes < dense.held_bytes / 3


def _writer(path: Path, arch: str) -> gguf.GGUFWriter:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_head_count(2)
    return w


def _close(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gemma_norms_lose_the_stored_plus_one(tmp_path: Path) -> None:
    path = tmp_path / "gemma.gguf"
    w = _writer(path, "gemma3")
    norm, q = np.linspace(0.5, 1.5, 64, dtype=np.float32), np.ones((64, 64), dtype=np.float32)
    w.add_tensor("blk.0.attn_norm.weight", norm)
    w.add_tensor("blk.0.attn_q_norm.weight", norm[:32])
    w.add_tensor("blk.0.attn_q.weight", q)
    _close(w)
    weights = GGUFWeights([path], torch.float32, CPU)
    assert np.allclose(weights("model.layers.0.input_layernorm.weight").numpy(), norm - 1)
    assert np.allclose(weights("model.layers.0.self_attn.q_norm.weight").numpy(), norm[:32] - 1)
    assert np.array_equal(weights("model.layers.0.self_attn.q_proj.weight").numpy(), q)  # not permuted, no offset


def test_moe_experts_are_slices_of_the_stacked_tensor(tmp_path: Path) -> None:
    path = tmp_path / "moe.gguf"
    w = _writer(path, "qwen3moe")
    rng = np.random.default_rng(3)
    gate = rng.standard_normal((4, 32, 64)).astype(np.float32)
    down = rng.standard_normal((4, 64, 32)).astype(np.float32)
    w.add_tensor("blk.0.ffn_gate_exps.weight", quantize_rows(gate), raw_dtype=T.Q8_0)
    w.add_tensor("blk.0.ffn_down_exps.weight", down)
    w.add_tensor("blk.0.ffn_gate_inp.weight", rng.standard_normal((4, 64)).astype(np.float32))
    _close(w)
    weights = GGUFWeights([path], torch.float32, CPU)
    for e in range(4):
        got = weights(f"model.layers.0.mlp.experts.{e}.gate_proj.weight")
        assert got.shape == (32, 64) and np.abs(got.numpy() - gate[e]).max() < 0.05
        assert np.array_equal(weights(f"model.layers.0.mlp.experts.{e}.down_proj.weight").numpy(), down[e])
    assert weights("model.layers.0.mlp.gate.weight").shape == (4, 64)


def quantize_rows(values: np.ndarray) -> np.ndarray:
    return gguf.quants.quantize(values, T.Q8_0)
