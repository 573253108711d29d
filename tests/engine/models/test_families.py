"""Every family against transformers on the same random checkpoint: prompt logprobs at 1e-4 in float32
(whole and in small chunks), and greedy tokens through the engine under mixed lengths, small prefill chunks,
preemption and prefix-cache hits; in bfloat16, greedy tokens equal to transformers' own bfloat16 run.

Prompts run past every window (8) and past the original rope length (32) of the yarn / longrope checkpoints.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.execution.model_runner import ModelRunner
from engine.messages import SamplingParams
from tests.engine.execution.test_model_runner import Blocks, new_seq, step
from tests.engine.models.families import FAMILIES
from tests.helpers.engine import run, tokens

ATOL = 1e-4
BLOCK = 4
NEW_TOKENS = 10
_HF: dict[tuple[Path, str], Any] = {}
_GREEDY: dict[tuple[Path, str, tuple[int, ...]], list[int]] = {}


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def hf_model(ckpt: Path, dtype: str = "float32") -> Any:
    from transformers import AutoModelForCausalLM

    if (ckpt, dtype) not in _HF:
        model: Any = AutoModelForCausalLM.from_pretrained(ckpt, dtype=getattr(torch, dtype))
        _HF[ckpt, dtype] = model.eval()
    return _HF[ckpt, dtype]


def hf_greedy(ckpt: Path, prompt: list[int], dtype: str = "float32") -> list[int]:
    key = (ckpt, dtype, tuple(prompt))
    if key not in _GREEDY:
        with torch.no_grad():
            out = hf_model(ckpt, dtype).generate(
                torch.tensor([prompt]),
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
                repetition_penalty=1.0,
                top_k=None,
                top_p=None,
                temperature=None,
                eos_token_id=None,
                pad_token_id=0,
            )
        _GREEDY[key] = out[0, len(prompt) :].tolist()
    return _GREEDY[key]


def prompts(seed: int, tails: list[int], shared: int = 33, vocab: int = 32_000) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(shared)]
    return [prefix + [rng.randrange(3, vocab) for _ in range(n)] for n in tails]


PROMPTS = prompts(7, [17, 3, 9, 1])  # 50, 36, 42, 34 tokens: past the windows and the original rope length
FAMILY_NAMES = list(FAMILIES)


@pytest.mark.parametrize("family_ckpt", FAMILY_NAMES, indirect=True)
def test_prompt_logprobs_match_transformers_whole_and_chunked(family_ckpt: Path) -> None:
    runner = ModelRunner(EngineConfig(model=str(family_ckpt), block_size=BLOCK, num_blocks=64))
    tokens_ = PROMPTS[0]
    with torch.no_grad():
        ref = hf_model(family_ckpt)(torch.tensor([tokens_])).logits[0].float()
    whole = new_seq("whole", tokens_, prompt_logprobs=1)
    out = step(runner, Blocks(64), [(whole, len(tokens_))])
    torch.testing.assert_close(out.prompt_logits[0], ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(out.logits[0], ref[-1], atol=ATOL, rtol=0)
    chunked, blocks, done = new_seq("chunked", tokens_, prompt_logprobs=0), Blocks(64, seed=3), 0
    for n in (5, 1, 7, 3, len(tokens_) - 16):  # chunks cut through the windows; one token takes the decode path
        out = step(runner, blocks, [(chunked, n)])
        torch.testing.assert_close(out.prompt_logits[0], ref[done : done + n], atol=ATOL, rtol=0)
        done += n
    torch.testing.assert_close(out.logits[0], ref[-1], atol=ATOL, rtol=0)


REGIMES: dict[str, dict[str, Any]] = {
    "mixed_lengths": dict(),
    "small_chunks": dict(max_num_batched_tokens=8),
    "preemption": dict(num_blocks=16),
    "prefix_cache": dict(max_num_batched_tokens=32),
}


@pytest.mark.parametrize("regime", list(REGIMES))
@pytest.mark.parametrize("family_ckpt", FAMILY_NAMES, indirect=True)
def test_greedy_matches_transformers(family_ckpt: Path, regime: str) -> None:
    kw: dict[str, Any] = dict(num_blocks=256, block_size=BLOCK) | REGIMES[regime]
    core = EngineCore(EngineConfig(model=str(family_ckpt), **kw))
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    # together, or one after another so later prompts find the shared prefix's blocks cached
    arrive = (lambda i: 12 * i) if regime in ("small_chunks", "prefix_cache") else (lambda i: 0)
    outs = run(core, [(f"r{i}", p, greedy, arrive(i)) for i, p in enumerate(PROMPTS)])
    for i, p in enumerate(PROMPTS):
        assert tokens(outs[f"r{i}"]) == hf_greedy(family_ckpt, p), (regime, i)
    stats = core.stats()
    if regime == "preemption":
        assert stats.num_preemptions > 0, "the small cache should have forced preemption"
    if regime == "prefix_cache":
        assert outs["r3"][0].num_cached_tokens >= 32  # the shared 33-token prefix, in whole blocks


@pytest.mark.parametrize("family_ckpt", FAMILY_NAMES, indirect=True)
def test_bfloat16_greedy_matches_transformers(family_ckpt: Path) -> None:
    """Half precision rounds as transformers does (rope, MoE sums, soft-caps in the model dtype), so greedy
    tokens are transformers' own bfloat16 ones, not merely close."""
    core = EngineCore(EngineConfig(model=str(family_ckpt), dtype="bfloat16", num_blocks=128, block_size=BLOCK))
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outs = run(core, [(f"r{i}", p, greedy, 0) for i, p in enumerate(PROMPTS[:2])])
    for i, p in enumerate(PROMPTS[:2]):
        assert tokens(outs[f"r{i}"]) == hf_greedy(family_ckpt, p, "bfloat16"), i


@pytest.mark.parametrize(
    "family_ckpt", ["qwen3", "qwen3_moe", "gemma2", "gemma3", "smollm3", "olmo3", "gemma4"], indirect=True
)
def test_triton_path_matches_transformers(family_ckpt: Path, tmp_path: Path) -> None:
    """The GPU path (Triton attention with per-layer windows and soft-caps, norms, rope, the fused MoE kernel),
    run by Triton's interpreter in a fresh process (TRITON_INTERPRET is read when triton is imported), against
    transformers' logits."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    from tests.engine.execution.test_model_runner import A_FULL, B_FULL

    out = tmp_path / "logits.pt"
    code = (
        "from tests.engine.execution.test_model_runner import kernel_path_child; "
        f"kernel_path_child({str(family_ckpt)!r}, {str(out)!r})"
    )
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=Path(__file__).parents[3],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(out)
    with torch.no_grad():
        ref_a, ref_b = (hf_model(family_ckpt)(torch.tensor([p])).logits[0].float() for p in (A_FULL, B_FULL))
    expected = [ref_a[:7], ref_a[7:17]] + [torch.stack([ref_a[17 + i], ref_b[5 + i]]) for i in range(3)]
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ["qwen3_moe", "gemma3"])
def test_sharded_bfloat16_checkpoint_loads(arch: str, tmp_path: Path) -> None:
    """Weights stored in bfloat16 across safetensors shards (experts split between files), served in
    float32: transformers' float32 model of the same files gives the same prompt logprobs."""
    from tests.engine.models.families import build_family

    ckpt = build_family(tmp_path, arch, dtype="bfloat16", shards=3)
    assert len(list(ckpt.glob("*.safetensors"))) >= 2
    runner = ModelRunner(EngineConfig(model=str(ckpt), block_size=BLOCK, num_blocks=64, dtype="float32"))
    seq = new_seq("a", PROMPTS[1], prompt_logprobs=1)
    out = step(runner, Blocks(64), [(seq, len(PROMPTS[1]))])
    with torch.no_grad():
        ref = hf_model(ckpt)(torch.tensor([PROMPTS[1]])).logits[0].float()
    torch.testing.assert_close(out.prompt_logits[0], ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family_ckpt", ["phi3"], indirect=True)
def test_longrope_within_the_original_length_uses_the_short_factors(family_ckpt: Path) -> None:
    """Served with --max-model-len 32 (the original length), longrope keeps its short factors: transformers'
    choice for every sequence that stays within it."""
    from tests.engine.models.families import ORIGINAL_ROPE_LENGTH

    core = EngineCore(
        EngineConfig(model=str(family_ckpt), max_model_len=ORIGINAL_ROPE_LENGTH, num_blocks=64, block_size=BLOCK)
    )
    prompt = PROMPTS[0][: ORIGINAL_ROPE_LENGTH - NEW_TOKENS]
    outs = run(core, [("r", prompt, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True), 0)])
    assert tokens(outs["r"]) == hf_greedy(family_ckpt, prompt)
    long_core = EngineCore(EngineConfig(model=str(family_ckpt), num_blocks=64, block_size=BLOCK))
    outs = run(long_core, [("r", prompt, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True), 0)])
    assert tokens(outs["r"]) != hf_greedy(family_ckpt, prompt)  # long factors: a different model below 32 tokens
