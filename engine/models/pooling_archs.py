"""Checkpoints only a pooling runner serves, read as the causal decoder they contain (Qwen2, Llama, Mistral):

- `*ForSequenceClassification`: the decoder plus a `score` head ([num_labels, hidden], no bias) that the engine's
  pooler applies to the pooled final-norm state (engine/execution/pooler.py), as transformers computes it;
- the base models (`Qwen2Model`, `LlamaModel`, `MistralModel`), as sentence-transformers saves its Transformer
  module: the decoder's weights without the "model." prefix.

Neither has an LM head: the token embedding is loaded once, as for tied embeddings.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.models.checkpoint_meta import ModelLoadError
from engine.models.weights import Weights

DECODER_OF = {
    "Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
    "LlamaForSequenceClassification": "LlamaForCausalLM",
    "MistralForSequenceClassification": "MistralForCausalLM",
    "Qwen2Model": "Qwen2ForCausalLM",
    "LlamaModel": "LlamaForCausalLM",
    "MistralModel": "MistralForCausalLM",
}
SCORE_WEIGHT = "score.weight"


def is_pooling_only(cfg: dict[str, Any]) -> bool:
    return any(a in DECODER_OF for a in cfg.get("architectures") or [])


def as_decoder_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Such a config read as its causal model's (others unchanged): the same decoder, the embedding standing in for
    the absent LM head, so it is loaded once and no head weight is looked for."""
    if not is_pooling_only(cfg):
        return cfg
    archs = [DECODER_OF.get(a, a) for a in cfg.get("architectures") or []]
    return {**cfg, "architectures": archs, "tie_word_embeddings": True}


def check_runner(cfg: dict[str, Any], runner: str) -> None:
    """A checkpoint without an LM head cannot generate: say so at load."""
    if runner != "pooling" and is_pooling_only(cfg):
        raise ModelLoadError(
            f"{cfg.get('architectures')} has no LM head, so it cannot generate text; serve it with --runner pooling"
        )


class _Unprefixed:
    """A base model's weights under the causal model's names ("model.layers.0..." read as "layers.0...")."""

    def __init__(self, weights: Weights) -> None:
        self.weights = weights

    def _name(self, name: str) -> str:
        return name if name in self.weights else name.removeprefix("model.")

    def __contains__(self, name: str) -> bool:
        return self._name(name) in self.weights

    def __call__(self, name: str) -> torch.Tensor:
        return self.weights(self._name(name))


def decoder_weights(weights: Weights) -> Weights | _Unprefixed:
    """What the decoder reads its weights through: the checkpoint's own names, or a base model's unprefixed ones."""
    if "model.embed_tokens.weight" in weights or "embed_tokens.weight" not in weights:
        return weights
    return _Unprefixed(weights)


def load_score_head(folder: Path, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The checkpoint's `score.weight` [num_labels, hidden] (ModelLoadError when missing)."""
    weights = Weights(folder, dtype, device, quiet=True)
    return weights(SCORE_WEIGHT)
