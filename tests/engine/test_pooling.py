"""Runner "pooling" in-process: embeddings equal transformers' last hidden state (after the final norm), pooled
the same way, for single, batched and chunked-prefill inputs; the blocks are free once a prompt is done."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.messages import AddRequest, RequestOutput, SamplingParams
from engine.pooler import Pooler


_HF: dict[Path, object] = {}


def hf_embedding(ckpt: Path, prompt: list[int], pooling: str, normalize: bool) -> torch.Tensor:
    from transformers import AutoModel

    if ckpt not in _HF:
        _HF[ckpt] = AutoModel.from_pretrained(ckpt, dtype=torch.float32).eval()
    model = _HF[ckpt]
    with torch.no_grad():
        hidden = model(torch.tensor([prompt])).last_hidden_state[0]  # type: ignore[operator]  # after the final norm
    v = hidden[-1] if pooling == "LAST" else hidden.mean(dim=0)
    return F.normalize(v, dim=-1) if normalize else v


def embed(core: EngineCore, prompts: list[list[int]]) -> list[RequestOutput]:
    for i, p in enumerate(prompts):
        core.add_request(AddRequest(f"r{i}", p, SamplingParams(max_tokens=1), arrival_time=0.0))
    outs: dict[str, RequestOutput] = {}
    steps = 0
    while core.has_work:
        for o in core.step():
            assert o.request_id not in outs, "one output per request"
            outs[o.request_id] = o
        steps += 1
        assert steps < 1000
    return [outs[f"r{i}"] for i in range(len(prompts))]


def make_prompts(vocab: int, lengths: list[int], seed: int = 0, shared: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab) for _ in range(shared)]
    return [prefix + [rng.randrange(vocab) for _ in range(n)] for n in lengths]


CASES = {
    "single": ([37], {}),
    "batched": ([5, 1, 23, 64, 17], {}),
    "chunked_prefill": ([100, 9, 70], dict(max_num_batched_tokens=16)),
    "shared_prefix": ([3, 20, 1], dict(block_size=8)),  # 40 shared tokens: LAST reuses them, MEAN may not
}


@pytest.mark.parametrize("pooling", ["LAST", "MEAN"])
@pytest.mark.parametrize("case", CASES)
def test_embeddings_match_transformers(qwen2_ckpt: Path, pooling: str, case: str) -> None:
    lengths, kw = CASES[case]
    kw = {"num_blocks": 64, **kw}
    core = EngineCore(EngineConfig(model=str(qwen2_ckpt), runner="pooling", pooling_type=pooling, **kw))  # type: ignore[arg-type]
    prompts = make_prompts(core.vocab_size, lengths, shared=40 if case == "shared_prefix" else 0)
    outs = embed(core, prompts)
    for prompt, out in zip(prompts, outs):
        assert out.finish_reason == "stop" and out.new_token_ids == [] and out.embedding is not None
        expected = hf_embedding(qwen2_ckpt, prompt, pooling, True)
        torch.testing.assert_close(torch.tensor(out.embedding), expected, atol=1e-4, rtol=1e-4)
    assert core.block_manager.num_used_blocks == 0  # no KV kept after the requests
    assert not core.pooler._sums  # type: ignore[union-attr]
    if case == "shared_prefix":  # MEAN reads every position: no prefix-cache hit may skip one
        assert (core.block_manager.prefix_cache_hits > 0) == (pooling == "LAST")


def test_unnormalized_and_full_context(llama_ckpt: Path) -> None:
    core = EngineCore(EngineConfig(model=str(llama_ckpt), runner="pooling", pooling_normalize=False,
                                   max_model_len=64, num_blocks=8))
    prompts = make_prompts(core.vocab_size, [64, 3])  # a prompt may fill the whole context: no output token
    for prompt, out in zip(prompts, embed(core, prompts)):
        assert out.embedding is not None
        torch.testing.assert_close(torch.tensor(out.embedding), hf_embedding(llama_ckpt, prompt, "LAST", False),
                                   atol=1e-4, rtol=1e-4)
    ready = core.ready_message()
    assert ready.hidden_size == 64 and not ready.is_matryoshka and ready.matryoshka_dimensions is None


def test_abort_mid_prompt_frees_everything(qwen2_ckpt: Path) -> None:
    core = EngineCore(EngineConfig(model=str(qwen2_ckpt), runner="pooling", pooling_type="MEAN",
                                   max_num_batched_tokens=8, num_blocks=64))
    core.add_request(AddRequest("a", list(range(1, 40)), SamplingParams(max_tokens=1), arrival_time=0.0))
    core.step()
    core.abort(["a"])
    (out,) = core.step()
    assert out.finish_reason == "abort" and out.embedding is None
    assert core.block_manager.num_used_blocks == 0 and not core.pooler._sums  # type: ignore[union-attr]


def test_too_long_is_refused(qwen2_ckpt: Path) -> None:
    core = EngineCore(EngineConfig(model=str(qwen2_ckpt), runner="pooling", max_model_len=16, num_blocks=8))
    core.add_request(AddRequest("a", list(range(1, 18)), SamplingParams(max_tokens=1), arrival_time=0.0))
    (out,) = core.step()
    assert out.finish_reason == "error" and "16" in (out.error or "")


def test_pooler_rejects_unknown_type() -> None:
    with pytest.raises(ValueError):
        Pooler("CLS")
    with pytest.raises(ValueError, match="pooling_type"):
        EngineConfig(model="x", runner="pooling", pooling_type="CLS")


def test_mean_survives_a_recompute_and_shares_steps() -> None:
    """MEAN sums positions 0..n-1 once each, even when a preempted prompt re-runs chunks it already summed."""
    from engine.sequence import ScheduledSeq, Sequence

    pooler = Pooler("MEAN", normalize=False)
    a = Sequence.new("a", list(range(10)), SamplingParams(max_tokens=0), 0.0)
    b = Sequence.new("b", list(range(3)), SamplingParams(max_tokens=0), 0.0)
    rows = torch.arange(10, dtype=torch.float32)[:, None].repeat(1, 2)  # position p's state is [p, p]

    def step(seq: Sequence, start: int, n: int) -> ScheduledSeq:
        seq.num_computed_tokens = start
        return ScheduledSeq(seq, n)

    assert pooler.pool([step(a, 0, 4)], rows[0:4]) == []
    assert pooler.pool([step(a, 0, 6)], rows[0:6]) == []  # recomputed from 0 after a preemption
    done = pooler.pool([step(b, 0, 3), step(a, 6, 4)], torch.cat([rows[0:3], rows[6:10]]))
    assert [(s.request_id, v) for s, v in done] == [("b", [1.0, 1.0]), ("a", [4.5, 4.5])]
    assert not pooler._sums
