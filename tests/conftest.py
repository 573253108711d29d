"""Shared fixtures: tiny random-weight checkpoints with real tokenizers, built once per session.

Shapes are tiny (hidden 64, 2 layers, 4 heads over 2 KV heads of dim 16) so tests stay fast;
vocabularies are the real tokenizers' so text round-trips through the model's ids.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

# Before any test module is imported: triton decorates its own @jit helpers (tl.sum, tl.cdiv) when first imported,
# interpreted only if this is set then, and any module may import it first (transformers does, via torch._dynamo).
os.environ["TRITON_INTERPRET"] = "1"

TINY: dict[str, Any] = dict(
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=128,
    max_position_embeddings=1024,
    seed=1234,
)

# Llama 3 style: untied head, frequencies rescaled (original length small so scaling shows at short range).
LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
MISTRAL_SLIDING_WINDOW = 8  # shorter than test prompts, so the window is exercised


def build_checkpoint(root: Path, arch: str) -> Path:
    from demo.checkpoints import write_random_checkpoint

    if arch == "qwen2":
        return write_random_checkpoint(
            root / "qwen2", "qwen2", **TINY, vocab_size=151_646, tie_word_embeddings=True, rope_theta=1_000_000.0
        )
    if arch == "llama":
        return write_random_checkpoint(
            root / "llama",
            "llama",
            **TINY,
            vocab_size=32_000,
            tie_word_embeddings=False,
            rope_theta=500_000.0,
            rope_scaling=LLAMA3_ROPE_SCALING,
        )
    return write_random_checkpoint(
        root / "mistral",
        "mistral",
        **TINY,
        vocab_size=32_000,
        tie_word_embeddings=False,
        rope_theta=10_000.0,
        sliding_window=MISTRAL_SLIDING_WINDOW,
    )


@pytest.fixture(scope="session")
def checkpoints_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="session")
def qwen2_ckpt(checkpoints_root: Path) -> Path:
    """Qwen2-shaped (q/k/v bias, tied embeddings), Qwen2 tokenizer with ChatML template."""
    return build_checkpoint(checkpoints_root, "qwen2")


@pytest.fixture(scope="session")
def llama_ckpt(checkpoints_root: Path) -> Path:
    """Llama-shaped with llama3 rope_scaling and an untied LM head, SentencePiece tokenizer."""
    return build_checkpoint(checkpoints_root, "llama")


@pytest.fixture(scope="session")
def mistral_ckpt(checkpoints_root: Path) -> Path:
    """Mistral-shaped with a sliding window of 8, SentencePiece tokenizer."""
    return build_checkpoint(checkpoints_root, "mistral")


@pytest.fixture(scope="session")
def any_ckpt(request: pytest.FixtureRequest) -> Path:
    """Parametrize with indirect=True over "qwen2" / "llama" / "mistral"."""
    return request.getfixturevalue(f"{request.param}_ckpt")


@pytest.fixture(scope="session")
def qwen2_vl_ckpt(checkpoints_root: Path) -> Path:
    """Qwen2VLForConditionalGeneration: hidden 64, 2 layers, M-RoPE [4, 6, 6], a 2-block vision tower of width 32;
    Qwen2.5's tokenizer with Qwen2-VL's chat template; preprocessor_config.json capped at 64 x 28 x 28 pixels."""
    from demo.checkpoints import write_random_vl_checkpoint

    return write_random_vl_checkpoint(
        checkpoints_root / "qwen2_vl", max_position_embeddings=1024, seed=7, max_pixels=64 * 28 * 28
    )


@pytest.fixture(scope="session")
def qwen2_cls_ckpt(checkpoints_root: Path) -> Path:
    """Qwen2ForSequenceClassification with 3 labels (label_a, label_b, label_c), random weights."""
    from tests.pooling_checkpoints import write_seq_cls

    return write_seq_cls(checkpoints_root / "qwen2_cls", "qwen2", 3)


@pytest.fixture(scope="session")
def qwen2_ce_ckpt(checkpoints_root: Path) -> Path:
    """Qwen2ForSequenceClassification with one label: a cross-encoder (sigmoid score)."""
    from tests.pooling_checkpoints import write_seq_cls

    return write_seq_cls(checkpoints_root / "qwen2_ce", "qwen2", 1, seed=11, chat_template=False)


@pytest.fixture(scope="session")
def st_mean_ckpt(checkpoints_root: Path, qwen2_ckpt: Path) -> Path:
    """sentence-transformers' layout over the Qwen2 checkpoint: MEAN pooling, Normalize, query/document prompts."""
    from tests.pooling_checkpoints import write_sentence_transformer

    return write_sentence_transformer(
        qwen2_ckpt, checkpoints_root / "st_mean", "mean", True, {"query": "query: ", "document": "passage: "}
    )


@pytest.fixture(scope="session")
def llama_cls_ckpt(checkpoints_root: Path) -> Path:
    """LlamaForSequenceClassification with 2 labels, SentencePiece tokenizer."""
    from tests.pooling_checkpoints import write_seq_cls

    return write_seq_cls(checkpoints_root / "llama_cls", "llama", 2, seed=5)
