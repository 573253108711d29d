"""A checkpoint folder's metadata, without torch: config.json and generation_config.json as the engine reads them.

The engine's loader and model runner read them here, and so does the render-only server
(server/render_app.py), which must state the same limits and sampling defaults as the engine would without
importing torch (tests/server/test_render_app.py checks its imports).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

# generation_config.json keys that become the server's default sampling parameters.
SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "max_new_tokens",
)
DEFAULT_MAX_POSITIONS = 4096  # a config.json that names no max_position_embeddings


class ModelLoadError(Exception):
    """The model could not be found or loaded; the message says what is missing and what to do."""


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} should hold a JSON object")
    return data


def read_config(folder: Path) -> dict[str, Any]:
    if not (folder / "config.json").exists():
        raise ModelLoadError(f"{folder} has no config.json; pass a Hugging Face format checkpoint folder")
    return read_json(folder / "config.json")


def read_generation_config(folder: Path) -> dict[str, Any]:
    """generation_config.json, or {} when the checkpoint has none."""
    path = folder / "generation_config.json"
    return read_json(path) if path.exists() else {}


def max_positions(cfg: dict[str, Any]) -> int:
    """The model's context limit; a vision checkpoint nests the language model's settings in text_config; an
    encoder-decoder (Whisper) names its decoder's as max_target_positions."""
    text = cfg.get("text_config") or {}
    return int(
        cfg.get("max_position_embeddings")
        or cfg.get("max_target_positions")
        or text.get("max_position_embeddings", DEFAULT_MAX_POSITIONS)
    )


def max_model_len(cfg: dict[str, Any], requested: int | None) -> int:
    """--max-model-len, or the model's limit when unset; more than the model's limit is refused."""
    limit = max_positions(cfg)
    if requested is not None and requested > limit:
        raise ModelLoadError(
            f"--max-model-len {requested} exceeds the model's max_position_embeddings {limit}; pass at most {limit}"
        )
    return requested or limit


def vocab_size(cfg: dict[str, Any], folder: Path) -> int:
    """config.json's vocab_size (a vision config may nest it in text_config): the embedding's rows."""
    vocab = cfg.get("vocab_size", (cfg.get("text_config") or {}).get("vocab_size"))
    if vocab is None:
        raise ModelLoadError(f"{folder / 'config.json'} has no vocab_size")
    return int(vocab)


def _id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def eos_token_ids(cfg: dict[str, Any], gen: dict[str, Any]) -> list[int]:
    """generation_config.json's eos_token_id (one or a list), else config.json's."""
    return _id_list(gen.get("eos_token_id")) or _id_list(cfg.get("eos_token_id"))


def generation_defaults(gen: dict[str, Any]) -> dict[str, float | int]:
    """The sampling parameters generation_config.json sets (SAMPLING_KEYS with numeric values)."""
    return {k: gen[k] for k in SAMPLING_KEYS if isinstance(gen.get(k), (int, float))}


def tokenizer_token_count(folder: Path) -> int | None:
    """How many ids the folder's tokenizer.json defines (None: no readable tokenizer.json).

    Checkpoints pad the embedding beyond the tokenizer (Qwen2.5: 151,936 rows, 151,665 tokens); ids past the
    tokenizer are not tokens, so the engine never samples them."""
    try:  # only the ids decoded: the merges and the rest skipped (0.08 s for Qwen2's 18 MB file, json.loads 0.4 s)
        data = msgspec.json.decode((folder / "tokenizer.json").read_bytes(), type=_TokenizerIds, strict=False)
    except (OSError, ValueError):  # msgspec's DecodeError and ValidationError are ValueErrors
        return None
    vocab = data.model.vocab
    top = (max(vocab.values(), default=-1) + 1) if isinstance(vocab, dict) else len(vocab)
    added = max((t.id + 1 for t in data.added_tokens or ()), default=0)
    return max(top, added) or None


class _AddedTokenId(msgspec.Struct):
    id: int


class _ModelVocab(msgspec.Struct):
    vocab: dict[str, int] | list[msgspec.Raw]  # BPE / WordPiece: token -> id; Unigram: [piece, score] pairs


class _TokenizerIds(msgspec.Struct):
    """What tokenizer_token_count reads of a tokenizer.json."""

    model: _ModelVocab
    added_tokens: list[_AddedTokenId] | None = None
