"""Gemma 4 beyond the family tests (tests/engine/models/test_families.py): the text part of a
Gemma4ForConditionalGeneration checkpoint (config under text_config, weights under model.language_model) gives
transformers' logits; the layers that share K/V hold no cache of their own; LoRA is refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.execution.model_runner import ModelRunner
from engine.models.checkpoint_meta import ModelLoadError
from tests.engine.execution.test_model_runner import Blocks, new_seq, step
from tests.engine.models.test_families import ATOL, BLOCK, PROMPTS


def conditional_generation(ckpt: Path, out: Path) -> tuple[Path, torch.nn.Module]:
    """The family checkpoint's text model inside a Gemma4ForConditionalGeneration without vision or audio."""
    from transformers import Gemma4Config, Gemma4ForCausalLM, Gemma4ForConditionalGeneration, Gemma4TextConfig

    text = Gemma4ForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    config = Gemma4Config(text_config=Gemma4TextConfig.from_pretrained(ckpt), vision_config=None, audio_config=None)
    model = Gemma4ForConditionalGeneration(config).eval()
    model.model.language_model.load_state_dict(text.model.state_dict())
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (ckpt / name).exists():
            (out / name).write_bytes((ckpt / name).read_bytes())
    return out, model


@pytest.mark.parametrize("family_ckpt", ["gemma4"], indirect=True)
def test_text_part_of_conditional_generation_matches_transformers(family_ckpt: Path, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    ckpt, model = conditional_generation(family_ckpt, tmp_path / "cg")
    tokens = PROMPTS[0]
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([tokens])).logits[0].float()
    runner = ModelRunner(EngineConfig(model=str(ckpt), block_size=BLOCK, num_blocks=64))
    out = step(runner, Blocks(64), [(new_seq("a", tokens, prompt_logprobs=1), len(tokens))])
    torch.testing.assert_close(out.prompt_logits[0], ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family_ckpt", ["gemma4"], indirect=True)
def test_sharing_layers_hold_no_cache(family_ckpt: Path) -> None:
    """6 layers, the last 2 reading layers 2's and 3's K/V: 4 caches, sized by each layer's own head shape."""
    runner = ModelRunner(EngineConfig(model=str(family_ckpt), block_size=BLOCK, num_blocks=32))
    assert len(runner.kv_caches) == 4
    assert [tuple(k.shape[-2:]) for k, _ in runner.kv_caches] == [(2, 16), (1, 32), (2, 16), (1, 32)]
    assert sum(k.numel() + v.numel() for k, v in runner.kv_caches) == 32 * BLOCK * 2 * 2 * (32 + 32)


@pytest.mark.parametrize("family_ckpt", ["gemma4"], indirect=True)
def test_lora_is_refused_in_one_line(family_ckpt: Path) -> None:
    with pytest.raises(ModelLoadError, match="--enable-lora serves models whose layers share one attention shape"):
        ModelRunner(EngineConfig(model=str(family_ckpt), block_size=BLOCK, num_blocks=8, enable_lora=True))
