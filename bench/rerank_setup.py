"""What `python -m bench.embed --rerank` measures on: a random-weight cross-encoder of the demo's shape
(Qwen2ForSequenceClassification, one label, Qwen2.5's tokenizer without a chat template, as a reranker has none)
and one query with documents of an exact token length."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import torch

from demo.checkpoints import DEMO
from engine.cache_root import cache_root

NAME = "bench-reranker-v1"


def reranker_checkpoint() -> Path:
    """The cross-encoder in the cache, built on first use."""
    path = cache_root() / NAME
    if path.is_dir():
        return path
    import transformers  # why late: only the benchmark's first run builds it

    from demo.tokenizers import write_tokenizer

    cfg = transformers.Qwen2Config(
        hidden_size=DEMO["hidden_size"],
        num_hidden_layers=DEMO["num_layers"],
        num_attention_heads=DEMO["num_heads"],
        num_key_value_heads=DEMO["num_kv_heads"],
        head_dim=DEMO["head_dim"],
        intermediate_size=DEMO["intermediate_size"],
        vocab_size=DEMO["vocab_size"],
        max_position_embeddings=4096,
        num_labels=1,
        pad_token_id=151643,
        architectures=["Qwen2ForSequenceClassification"],
    )
    torch.manual_seed(0)
    model = transformers.Qwen2ForSequenceClassification(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape) / math.sqrt(p.shape[-1]))
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp)
    write_tokenizer("qwen2.5", tmp)
    tok_config = json.loads((tmp / "tokenizer_config.json").read_text())
    tok_config.pop("chat_template", None)
    (tmp / "tokenizer_config.json").write_text(json.dumps(tok_config))
    (tmp / "chat_template.jinja").unlink(missing_ok=True)
    tmp.rename(path)
    return path


def texts_of_length(tokenizer_file: Path, count: int, length: int, seed: int) -> list[str]:
    """`count` texts of exactly `length` tokens each (space-separated words the tokenizer keeps whole)."""
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    # a word with its leading space is one token ("Ġword" is in the vocabulary), and the pre-tokenizer splits at
    # spaces, so " w1 w2 ..." of n words is n tokens
    words = sorted(
        w[1:] for w in tok.get_vocab() if w.startswith("Ġ") and w[1:].isascii() and w[1:].isalpha() and len(w) > 3
    )
    rng = random.Random(seed)
    out = ["".join(" " + rng.choice(words) for _ in range(length)) for _ in range(count)]
    assert all(len(tok.encode(t).ids) == length for t in out)
    return out
