"""Which model class runs which checkpoint: config.json's `architectures` -> a family (its parser and class).

Adding a family: a module that turns its config.json into `ModelArgs` (engine/models/args.py), and a row here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.models import (
    gemma,
    gemma4,
    granite_hybrid,
    lfm2,
    llama,
    moe_families,
    olmo,
    phi3,
    qwen2_vl,
    qwen3_5,
    whisper,
)
from engine.models.args import ConfigError, ModelArgs
from engine.models.decoder import CausalLM


@dataclass(frozen=True)
class Family:
    parse: Callable[[dict[str, Any], str], ModelArgs]  # (config.json, architecture name) -> ModelArgs
    model: type[CausalLM] = CausalLM
    tensor_parallel: bool = True


MODELS: dict[str, Family] = {
    "LlamaForCausalLM": Family(llama.parse),
    "MistralForCausalLM": Family(llama.parse),
    "Qwen2ForCausalLM": Family(llama.parse),
    "Qwen3ForCausalLM": Family(llama.parse),
    "Qwen3MoeForCausalLM": Family(moe_families.parse_qwen3_moe),
    "MixtralForCausalLM": Family(moe_families.parse_mixtral),
    "Gemma2ForCausalLM": Family(gemma.parse_gemma2),
    "Gemma3ForCausalLM": Family(gemma.parse_gemma3),
    "Phi3ForCausalLM": Family(phi3.parse),
    "SmolLM3ForCausalLM": Family(llama.parse_smollm3),
    # q and k normed over all heads at once: a rank would need every head
    "Olmo2ForCausalLM": Family(olmo.parse_olmo2, tensor_parallel=False),
    "Olmo3ForCausalLM": Family(olmo.parse_olmo3, tensor_parallel=False),
    "Gemma4ForCausalLM": Family(gemma4.parse, gemma4.Gemma4CausalLM, tensor_parallel=False),
    # its text part: images and audio are not served
    "Gemma4ForConditionalGeneration": Family(gemma4.parse, gemma4.Gemma4CausalLM, tensor_parallel=False),
    qwen2_vl.ARCHITECTURE: Family(qwen2_vl.parse, qwen2_vl.Qwen2VLCausalLM, tensor_parallel=False),
    whisper.ARCHITECTURE: Family(whisper.parse, whisper.WhisperModel, tensor_parallel=False),
    # hybrids: recurrent layers with a state per sequence beside attention (engine/models/hybrid.py)
    lfm2.ARCHITECTURE: Family(lfm2.parse, lfm2.Lfm2LM, tensor_parallel=False),
    qwen3_5.ARCHITECTURE: Family(qwen3_5.parse, qwen3_5.Qwen35LM, tensor_parallel=False),
    granite_hybrid.ARCHITECTURE: Family(granite_hybrid.parse, granite_hybrid.GraniteHybridLM, tensor_parallel=False),
}


def supported() -> str:
    return ", ".join(MODELS)


def family_of(cfg: dict[str, Any]) -> tuple[str, Family]:
    """The first of config.json's architectures that has a family here; ConfigError naming them otherwise."""
    archs = [str(a) for a in cfg.get("architectures") or []]
    for arch in archs:
        if arch in MODELS:
            return arch, MODELS[arch]
    named = ", ".join(archs) if archs else "missing (config.json has no architectures)"
    raise ConfigError(f"architecture {named} is not supported; supported: {supported()}")


def parse_config(cfg: dict[str, Any]) -> ModelArgs:
    """config.json -> ModelArgs; ConfigError naming the unsupported architecture, field or value."""
    arch, family = family_of(cfg)
    try:
        return family.parse(cfg, arch)
    except KeyError as e:
        raise ConfigError(f"{arch} config.json lacks {e}") from e
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{arch} config.json has a malformed value: {e}") from e
