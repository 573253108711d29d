"""Per-layer sliding windows over the paged cache against transformers: prompts and generations past the
window, chunked prefill cutting through it, prefix-cache hits, preemption, and released blocks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.execution.model_runner import ModelRunner
from engine.messages import AddRequest, SamplingParams
from tests.engine.execution.test_model_runner import Blocks, hf_logits, new_seq, prompt, step

WINDOW = 4
PATTERN = [WINDOW, None, WINDOW, None]  # local and global layers, as Gemma alternates them
VOCAB = 1000
ATOL = 1e-4


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from demo.checkpoints import write_random_checkpoint

    return write_random_checkpoint(
        tmp_path_factory.mktemp("win") / "qwen2x4",
        "qwen2",
        hidden_size=64,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=VOCAB,
        tie_word_embeddings=True,
        rope_theta=10_000.0,
        max_position_embeddings=256,
        seed=99,
        tokenizer=False,
    )


@pytest.fixture(scope="module")
def hf(ckpt: Path) -> Any:
    """transformers' Qwen2 with sliding-window layers where PATTERN has a window: the dense masked reference."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(ckpt)
    cfg.use_sliding_window, cfg.sliding_window = True, WINDOW
    cfg.layer_types = ["full_attention" if w is None else "sliding_attention" for w in PATTERN]
    model: Any = AutoModelForCausalLM.from_pretrained(ckpt, config=cfg, dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None
    return model


def windowed_runner(ckpt: Path, **kw: object) -> ModelRunner:
    runner = ModelRunner(EngineConfig(model=str(ckpt), block_size=4, num_blocks=64, **kw))  # type: ignore[arg-type]
    runner.model.layer_windows = list(PATTERN)
    return runner


def test_the_window_matters(ckpt: Path, hf: Any) -> None:
    """Without the windows the logits differ: the tests below could fail."""
    runner = ModelRunner(EngineConfig(model=str(ckpt), block_size=4, num_blocks=64))
    tokens = prompt(21, seed=1, vocab=VOCAB)
    out = step(runner, Blocks(64), [(new_seq("a", tokens), 21)])
    assert not torch.allclose(out.logits[0], hf_logits(hf, tokens)[-1], atol=1e-2)


def test_prompt_past_the_window_and_chunks_smaller_than_it(ckpt: Path, hf: Any) -> None:
    runner = windowed_runner(ckpt)
    tokens = prompt(23, seed=2, vocab=VOCAB)
    ref = hf_logits(hf, tokens)
    whole = step(runner, Blocks(64, seed=1), [(new_seq("a", tokens, prompt_logprobs=0), 23)])
    torch.testing.assert_close(whole.prompt_logits[0], ref, atol=ATOL, rtol=0)
    seq, blocks, done = new_seq("b", tokens, prompt_logprobs=0), Blocks(64, seed=2), 0
    for n in (3, 1, 2, 5, 3, 9):  # chunks shorter than the window, mid-block starts, one decode-sized
        out = step(runner, blocks, [(seq, n)])
        torch.testing.assert_close(out.prompt_logits[0], ref[done : done + n], atol=ATOL, rtol=0)
        done += n


def test_batched_decode_past_the_window_with_a_prefix_hit(ckpt: Path, hf: Any) -> None:
    """Mixed lengths (1, block_size, block_size + 1, long) decode together; c reuses a's first blocks."""
    runner = windowed_runner(ckpt)
    blocks = Blocks(64, seed=3)
    seqs = [new_seq(f"s{n}", prompt(n, seed=n, vocab=VOCAB)) for n in (1, 4, 5, 19)]
    out = step(runner, blocks, [(s, s.num_tokens) for s in seqs])
    logits = dict(zip([s.request_id for s in seqs], out.logits))
    a = seqs[-1]
    c = new_seq("c", a.token_ids[:12] + prompt(3, seed=50, vocab=VOCAB))
    c.block_table, c.num_computed_tokens = a.block_table[:3], 12
    for i in range(6):
        for s in seqs:
            s.token_ids.append(int(logits[s.request_id].argmax()))
        work = [(s, 1) for s in seqs]
        if i == 1:
            work.insert(2, (c, 3))
            seqs.insert(2, c)
        out = step(runner, blocks, work)
        logits = {s.request_id: row for (s, _), row in zip(work, out.logits)}
        for s in seqs:
            torch.testing.assert_close(logits[s.request_id], hf_logits(hf, s.token_ids)[-1], atol=ATOL, rtol=0)


def test_bfloat16_greedy_close(ckpt: Path, hf: Any) -> None:
    runner = windowed_runner(ckpt, dtype="bfloat16")
    tokens = prompt(18, seed=4, vocab=VOCAB)
    seq, blocks = new_seq("a", tokens), Blocks(64, seed=5)
    step(runner, blocks, [(seq, 17)])
    out = step(runner, blocks, [(seq, 1)])
    ref = hf_logits(hf, tokens)[-1]
    torch.testing.assert_close(out.logits[0], ref, atol=0.25, rtol=0.05)
    assert float(ref[int(out.logits[0].argmax())]) >= float(ref.max()) - 0.05


def greedy_run(core: EngineCore, prompts: list[list[int]], n: int, stagger: int = 2) -> dict[str, list[int]]:
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    step_no = 0
    while step_no < stagger * len(prompts) or core.has_work:
        if step_no % stagger == 0 and step_no // stagger < len(prompts):
            i = step_no // stagger
            core.add_request(AddRequest(f"r{i}", prompts[i], params, arrival_time=float(step_no)))
        for o in core.step():
            out[o.request_id] += o.new_token_ids
        step_no += 1
        assert step_no < 5000
    return out


def hf_greedy(model: Any, tokens: list[int], n: int) -> list[int]:
    with torch.no_grad():
        ref = model.generate(
            torch.tensor([tokens]),
            do_sample=False,
            max_new_tokens=n,
            min_new_tokens=n,
            temperature=None,
            top_p=None,
            top_k=None,
            repetition_penalty=None,
            pad_token_id=0,
        )
    return list(ref[0, len(tokens) :].tolist())


@pytest.mark.parametrize(
    "regime",
    [
        dict(max_num_batched_tokens=3),  # chunks shorter than the window
        dict(num_blocks=9, block_size=4, max_num_batched_tokens=16),
    ],
)  # preemption
def test_engine_greedy_with_layer_windows(ckpt: Path, hf: Any, regime: dict[str, int]) -> None:
    kw: dict[str, Any] = {"num_blocks": 64, "block_size": 4, **regime}
    core = EngineCore(EngineConfig(model=str(ckpt), **kw))
    core.runner.model.layer_windows = list(PATTERN)
    shared = prompt(10, seed=7, vocab=VOCAB)  # a shared prefix: later requests hit the prefix cache
    prompts = [shared + prompt(n, seed=8 + n, vocab=VOCAB) for n in (3, 11, 6)]
    out = greedy_run(core, prompts, 14)
    for i, p in enumerate(prompts):
        assert out[f"r{i}"] == hf_greedy(hf, p, 14), i
    stats = core.stats()
    assert stats.prefix_cache_hits > 0 and stats.num_used_blocks == 0
    if "num_blocks" in regime:
        assert stats.num_preemptions > 0


def test_all_layers_windowed_release_passed_blocks(mistral_ckpt: Path) -> None:
    """Mistral (window 8 on every layer): a long generation holds a window's worth of blocks, not its length,
    and a repeated prompt is still served from the prefix cache, token for token as transformers."""
    from transformers import AutoModelForCausalLM

    core = EngineCore(EngineConfig(model=str(mistral_ckpt), num_blocks=64, block_size=4, max_num_batched_tokens=8))
    assert core.block_manager.window == 8
    tokens = prompt(30, seed=11)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    got: list[int] = []
    most = 0
    for rid in ("a", "b"):
        core.add_request(AddRequest(rid, tokens, params, arrival_time=0.0))
        out: list[int] = []
        while core.has_work:
            for o in core.step():
                out += o.new_token_ids
            most = max(most, core.stats().num_used_blocks)
        got = got or out
        assert out == got
    # window 8 + a chunk of 8 over blocks of 4: at most 5 blocks at once (70 tokens would take 18)
    assert most <= core.block_manager.most_blocks_held(70, 8) == 5
    assert core.stats().prefix_cache_hits > 0
    hf: Any = AutoModelForCausalLM.from_pretrained(mistral_ckpt, dtype=torch.float32)
    hf.eval()
    hf.generation_config.eos_token_id = None
    assert got == hf_greedy(hf, tokens, 40)


def kernel_path_child(ckpt: str, out: str) -> None:
    """Subprocess entry: the Triton path (interpreted on CPU) with per-layer windows, a chunked prompt, decodes."""
    torch.set_num_threads(1)
    runner = ModelRunner(EngineConfig(model=ckpt, block_size=4, num_blocks=64), use_triton=True)
    runner.model.layer_windows = list(PATTERN)
    tokens = prompt(15, seed=12, vocab=VOCAB)
    seq, blocks = new_seq("a", tokens[:13], prompt_logprobs=0), Blocks(64, seed=13)
    got = [step(runner, blocks, [(seq, 6)]).prompt_logits[0], step(runner, blocks, [(seq, 7)]).prompt_logits[0]]
    for t in tokens[13:]:
        seq.token_ids.append(t)
        got.append(step(runner, blocks, [(seq, 1)]).logits.clone())
    torch.save(got, out)


def test_triton_path_with_layer_windows(ckpt: Path, hf: Any, tmp_path: Path) -> None:
    pytest.importorskip("triton")
    out = tmp_path / "logits.pt"
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parents[2])!r}); "
        f"from tests.engine import test_sliding_window as t; t.kernel_path_child({str(ckpt)!r}, {str(out)!r})"
    )
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parents[2],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(out)
    ref = hf_logits(hf, prompt(15, seed=12, vocab=VOCAB))
    expected = [ref[:6], ref[6:13], ref[13:14], ref[14:15]]
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, atol=ATOL, rtol=0)
