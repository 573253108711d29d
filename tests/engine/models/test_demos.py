"""`spindle make-demo --arch NAME PATH`: each family's demo checkpoint, with a real tokenizer, loads and runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from demo.checkpoints import FAMILY_DEMOS, make_demo_command
from engine.models.loader import load_model
from engine.models.registry import MODELS


def test_make_demo_arch_writes_a_checkpoint_of_that_family(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.set_num_threads(1)
    assert make_demo_command(["--arch", "mixtral", str(tmp_path / "mixtral")]) == 0
    folder = Path(capsys.readouterr().out.strip())
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["MixtralForCausalLM"] and cfg["num_local_experts"] == 8
    assert (folder / "tokenizer.json").exists() and (folder / "generation_config.json").exists()
    model, info = load_model(folder, "auto", "cpu")
    assert info.vocab_size == 32_000 and model.args.moe is not None
    assert set(FAMILY_DEMOS) >= {"qwen3", "qwen3_moe", "gemma2", "gemma3", "phi3", "mixtral"}


@pytest.mark.parametrize("args", [["--arch", "gpt2", "x"], ["--arch", "qwen3"], [], ["--vision"]])
def test_a_bad_make_demo_line_prints_the_usage(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert make_demo_command(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: spindle make-demo [--vision | --whisper | --arch {qwen2,") and "qwen3_moe" in err


def test_every_demo_is_a_registered_architecture() -> None:
    import transformers

    from demo.checkpoints import _CLASSES

    for spec in FAMILY_DEMOS.values():
        name = _CLASSES[spec["arch"]][1]
        assert name in MODELS and hasattr(transformers, name)
