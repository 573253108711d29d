"""Shared by the speculative engine tests: the drafting oracle (drafts read from a plain run's output) and a
noisy draft model."""

from __future__ import annotations

import random
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.spec import speculator


@pytest.fixture
def oracle(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[tuple[int, ...], list[int]]]:
    """Drafts read from references (prompt -> prompt + output), every third draft token off by one."""
    refs: dict[tuple[int, ...], list[int]] = {}
    rng = random.Random(7)

    def propose(ids: list[int], k: int, n_max: int, n_min: int) -> list[int]:
        ref = next((r for p, r in refs.items() if ids[: len(p)] == list(p) and ids == r[: len(ids)]), None)
        if ref is None:
            return []
        draft = ref[len(ids) : len(ids) + k]
        return [t + 1 if rng.random() < 0.3 else t for t in draft]

    monkeypatch.setattr(speculator.ngram, "propose", propose)
    yield refs


@pytest.fixture(scope="session")
def noisy_draft(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    """The qwen2 checkpoint with noise in its MLPs: it agrees with the target often, not always."""
    src: Path = request.getfixturevalue("qwen2_ckpt")
    dst = tmp_path_factory.mktemp("draft") / "noisy"
    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    for name, w in weights.items():
        if "mlp" in name:
            weights[name] = w + 0.6 * w.std() * torch.randn(w.shape, generator=gen)
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture
def free_draft(monkeypatch: pytest.MonkeyPatch) -> None:
    """A draft model's own cost not weighed: tiny checkpoints' drafts cost as much as their targets, and these
    tests check what the draft path emits, not whether it pays (engine/spec/speculator.py)."""
    monkeypatch.setenv("SPINDLE_SPEC_DRAFT_COST", "0")
