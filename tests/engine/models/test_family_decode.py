"""Every family's logits at each of 16 greedy steps (the decode path, one token a step) against transformers' own,
in float32 at 1e-4; Phi-3's longrope on both sides of its switch point (the original length, 32).

longrope's factors are chosen once per served model (engine/models/rope.py, as vLLM): short when
--max-model-len stays within the original length, long otherwise. transformers chooses per call by the longest
position, so the two agree on sequences that stay within 32 when served at 32, and on prompts already past 32.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.execution.model_runner import ModelRunner
from tests.engine.execution.test_model_runner import Blocks, hf_logits, new_seq, step
from tests.engine.models.families import FAMILIES, ORIGINAL_ROPE_LENGTH
from tests.helpers.engine import hf_greedy, hf_model

ATOL = 1e-4
BLOCK = 4
STEPS = 16
# a 12-token prompt: with its 16 tokens it stays within 32; 16 tokens: exactly 32, the last length on short factors;
# 33: one past the switch from the first step; 50: past it and past every window
BASE = [5, 17, 42, 99, 7, 3, 250, 11, 3001, 29_999, 1234, 77, 900, 31_000, 64, 8]
CASES = [
    ("phi3", ORIGINAL_ROPE_LENGTH, 12),
    ("phi3", ORIGINAL_ROPE_LENGTH, ORIGINAL_ROPE_LENGTH - STEPS),
    ("phi3", None, ORIGINAL_ROPE_LENGTH + 1),
] + [(arch, None, 50) for arch in FAMILIES]


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.mark.parametrize(("family_ckpt", "max_model_len", "prompt_len"), CASES, indirect=["family_ckpt"])
def test_each_greedy_step_matches_transformers_logits(
    family_ckpt: Path, max_model_len: int | None, prompt_len: int
) -> None:
    prompt = (BASE * (prompt_len // len(BASE) + 1))[:prompt_len]
    generated = hf_greedy(family_ckpt, prompt, STEPS)
    ref = hf_logits(hf_model(family_ckpt), prompt + generated)
    runner = ModelRunner(
        EngineConfig(model=str(family_ckpt), block_size=BLOCK, num_blocks=64, max_model_len=max_model_len)
    )
    seq, blocks = new_seq("s", prompt + generated, prompt_logprobs=0), Blocks(64)
    got = [step(runner, blocks, [(seq, prompt_len)]).prompt_logits[0]]
    got += [step(runner, blocks, [(seq, 1)]).prompt_logits[0] for _ in range(STEPS)]  # each alone: decode steps
    for i, logits in enumerate(torch.cat(got)):
        torch.testing.assert_close(logits, ref[i], atol=ATOL, rtol=0, msg=f"position {i}")
    assert torch.cat(got)[prompt_len - 1 : -1].argmax(-1).tolist() == generated
