"""`spindle make-demo --whisper PATH`: a random tiny Whisper checkpoint with Whisper's real tokenizer.

The vocabulary is `multilingual.tiktoken` from the `openai-whisper` package (found without importing it: its
package imports torch and numba), converted by transformers' TikTokenConverter; the special tokens follow at
their real ids (server/multimodal/whisper_tokens.py), so <|endoftext|> is 50257, <|startoftranscript|> 50258,
<|notimestamps|> 50363 and timestamps start at 50364. The folder holds what transformers' Whisper classes read:
config.json, generation_config.json (lang_to_id, task_to_id, suppress tokens, ...), preprocessor_config.json
(WhisperFeatureExtractor) and the tokenizer files, so both spindle and transformers load it offline.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import tokenizers
import torch

from demo.tokenizers import tiktoken_tokenizer
from server.multimodal.whisper_tokens import LANGUAGES, NUM_RANKS, PATTERN, special_tokens

EOT, SOT, NO_TIMESTAMPS = "<|endoftext|>", "<|startoftranscript|>", "<|notimestamps|>"
NUM_LANGUAGES = 99
DEMO_SHAPE: dict[str, Any] = {
    "d_model": 64,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 2,
    "decoder_attention_heads": 2,
    "encoder_ffn_dim": 256,
    "decoder_ffn_dim": 256,
}
# openai/whisper-tiny's: the first generated token may not be a space or <|endoftext|>; never these symbols
BEGIN_SUPPRESS = [220, 50257]


def build_tokenizer() -> tokenizers.Tokenizer:
    base = tiktoken_tokenizer(
        "whisper",
        "assets/multilingual.tiktoken",
        PATTERN,
        "the Whisper tokenizer's vocabulary ships in openai-whisper: pip install openai-whisper",
    )
    if base.get_vocab_size() != NUM_RANKS:
        raise RuntimeError(f"multilingual.tiktoken has {base.get_vocab_size()} ranks, expected {NUM_RANKS}")
    specials = special_tokens(NUM_LANGUAGES)
    base.add_special_tokens([tokenizers.AddedToken(t, normalized=False, special=True) for t in specials])
    if base.token_to_id(SOT) != 50258 or base.token_to_id(NO_TIMESTAMPS) != 50363:
        raise RuntimeError(f"{SOT} got id {base.token_to_id(SOT)}, {NO_TIMESTAMPS} {base.token_to_id(NO_TIMESTAMPS)}")
    return base


def _suppress_tokens(tok: tokenizers.Tokenizer) -> list[int]:
    """openai-whisper's default suppression: symbols that are not speech, and the special tokens other than eot."""
    symbols = list('"#()*+/:;<=>@[\\]^_`{|}~「」『』') + [
        "<<",
        ">>",
        "<<<",
        ">>>",
        "--",
        "---",
        "-(",
        "-[",
        "('",
        '("',
        "((",
        "))",
        "(((",
        ")))",
        "[[",
        "]]",
        "{{",
        "}}",
        "♪♪",
        "♪♪♪",
    ]
    out: set[int] = {tok.encode(" -").ids[0], tok.encode(" '").ids[0]}
    for s in symbols:
        for text in (s, " " + s):
            ids = tok.encode(text).ids
            if len(ids) == 1:
                out.add(ids[0])
    for name in ("<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", SOT):
        tid = tok.token_to_id(name)
        if tid is not None:
            out.add(tid)
    return sorted(out)


def generation_config(tok: tokenizers.Tokenizer) -> dict[str, Any]:
    """What transformers' WhisperForConditionalGeneration.generate and spindle read."""
    langs = {f"<|{c}|>": tok.token_to_id(f"<|{c}|>") for c in list(LANGUAGES)[:NUM_LANGUAGES]}
    return {
        "decoder_start_token_id": 50258,
        "bos_token_id": 50257,
        "eos_token_id": 50257,
        "pad_token_id": 50257,
        "is_multilingual": True,
        "lang_to_id": langs,
        "task_to_id": {"transcribe": tok.token_to_id("<|transcribe|>"), "translate": tok.token_to_id("<|translate|>")},
        "no_timestamps_token_id": 50363,
        "prev_sot_token_id": tok.token_to_id("<|startofprev|>"),
        "max_initial_timestamp_index": 50,
        "max_length": 448,
        "begin_suppress_tokens": BEGIN_SUPPRESS,
        "suppress_tokens": _suppress_tokens(tok),
        "alignment_heads": [[1, 0], [1, 1]],
    }


def write_tokenizer(path: Path, tok: tokenizers.Tokenizer) -> None:
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "WhisperTokenizer",
        "bos_token": EOT,
        "eos_token": EOT,
        "unk_token": EOT,
        "pad_token": EOT,
        "model_max_length": 1024,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "add_prefix_space": False,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def make_whisper_demo(path: str | Path, seed: int = 0) -> Path:
    """Write the checkpoint into `path` (created); returns it."""
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    config = WhisperConfig(
        vocab_size=tok.get_vocab_size(),
        num_mel_bins=80,
        max_source_positions=1500,
        max_target_positions=448,
        bos_token_id=50257,
        eos_token_id=50257,
        pad_token_id=50257,
        decoder_start_token_id=50258,
        begin_suppress_tokens=BEGIN_SUPPRESS,
        **DEMO_SHAPE,
    )
    torch.manual_seed(seed)
    model = WhisperForConditionalGeneration(config).eval()  # type: ignore[no-untyped-call]
    with torch.no_grad():  # a larger spread than the init's 0.02: greedy tokens vary with the audio
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    model.save_pretrained(out, safe_serialization=True)
    gen = generation_config(tok)
    (out / "generation_config.json").write_text(json.dumps(gen, indent=1))
    WhisperFeatureExtractor(feature_size=80).save_pretrained(out)  # type: ignore[no-untyped-call]
    write_tokenizer(out, tok)
    return out
