"""Random-weight checkpoints for the pooling runner, built with the reference libraries themselves:
transformers' `*ForSequenceClassification` (a `score` head), and sentence-transformers' own `save` of a
Transformer + Pooling (+ Normalize) stack over a causal checkpoint (a `Qwen2Model` with unprefixed weights,
modules.json, 1_Pooling/config.json, config_sentence_transformers.json)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from tests.conftest import TINY

_SEQ_CLS = {
    "qwen2": ("Qwen2Config", "Qwen2ForSequenceClassification", 151_646, 151_643),
    "llama": ("LlamaConfig", "LlamaForSequenceClassification", 32_000, 0),
}


def write_seq_cls(
    path: Path, arch: str, num_labels: int, seed: int = 7, chat_template: bool = True, **config: Any
) -> Path:
    """A `*ForSequenceClassification` checkpoint with `num_labels` labels (id2label named) and the arch's tokenizer;
    `config` adds config.json keys (problem_type, sentence_transformers, ...). Without `chat_template` (a
    cross-encoder's tokenizer has none), sentence-transformers' CrossEncoder joins a pair as the tokenizer does;
    with one, version 6 renders pairs as chat messages instead."""
    import transformers

    from demo.tokenizers import write_tokenizer

    config_name, model_name, vocab, pad = _SEQ_CLS[arch]
    names = {i: f"label_{chr(97 + i)}" for i in range(num_labels)}
    cfg = getattr(transformers, config_name)(
        hidden_size=TINY["hidden_size"],
        num_hidden_layers=TINY["num_layers"],
        num_attention_heads=TINY["num_heads"],
        num_key_value_heads=TINY["num_kv_heads"],
        head_dim=TINY["head_dim"],
        intermediate_size=TINY["intermediate_size"],
        vocab_size=vocab,
        max_position_embeddings=1024,
        num_labels=num_labels,
        id2label=names,
        label2id={v: k for k, v in names.items()},
        tie_word_embeddings=False,
        pad_token_id=pad,
        architectures=[model_name],
        **config,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # unit-size activations and logits that spread (init's 0.02 std makes them all ~0)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    model.save_pretrained(path)
    write_tokenizer(arch, path)  # type: ignore[arg-type]
    if not chat_template:
        drop_chat_template(path)
    return path


def drop_chat_template(folder: Path) -> None:
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    tok_config.pop("chat_template", None)
    (folder / "tokenizer_config.json").unlink()
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)


def write_sentence_transformer(
    src: Path,
    path: Path,
    mode: str,
    normalize: bool,
    prompts: dict[str, str] | None = None,
    default_prompt_name: str | None = None,
) -> Path:
    """sentence-transformers' layout over the causal checkpoint `src`: pooling `mode` (cls, mean, lasttoken).

    The tokenizer keeps no chat template: sentence-transformers 6 would otherwise read inputs as chat messages and
    put a prompt in a system message; without one a prompt is text put before the input (as in earlier releases,
    the checkpoints on the hub, and vLLM)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    plain = path.parent / f".{path.name}-src"
    with_config(src, plain)
    drop_chat_template(plain)
    transformer = Transformer(str(plain))
    stack = [transformer, Pooling(transformer.get_embedding_dimension(), mode)]
    if normalize:
        stack.append(Normalize())
    st = SentenceTransformer(modules=stack, prompts=prompts, default_prompt_name=default_prompt_name)
    st.save(str(path))
    return path


def with_config(src: Path, path: Path, **keys: Any) -> Path:
    """A copy of `src` whose config.json has `keys` added (links to the weights: nothing large is copied)."""
    path.mkdir(parents=True)
    for f in src.iterdir():
        if f.name != "config.json":
            (path / f.name).symlink_to(f.resolve())
    cfg = json.loads((src / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **keys}))
    return path
