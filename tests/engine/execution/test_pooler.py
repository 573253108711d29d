"""Runner "pooling" in-process: every pooler's raw output equals transformers' final-norm hidden states pooled the
same way (LAST, CLS, MEAN, ALL, STEP), and a classifier's equals AutoModelForSequenceClassification's logits, for
single, batched, chunked-prefill and shared-prefix inputs; the blocks and partial pools are freed once done."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.execution.pooler import Pooler
from engine.messages import AddRequest, PooledData, RequestOutput, SamplingParams
from engine.models.checkpoint_meta import ModelLoadError

_HF: dict[tuple[Path, str], object] = {}


def hf_hidden(ckpt: Path, prompt: list[int], classify: bool = False) -> torch.Tensor:
    """transformers' last hidden state [T, H] (after the final norm), or a classifier's logits [labels]."""
    from transformers import AutoModel, AutoModelForSequenceClassification

    key = (ckpt, "cls" if classify else "base")
    if key not in _HF:
        cls = AutoModelForSequenceClassification if classify else AutoModel
        _HF[key] = cls.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        out = _HF[key](torch.tensor([prompt]))  # type: ignore[operator]
    return out.logits[0] if classify else out.last_hidden_state[0]


def pooled(o: RequestOutput) -> torch.Tensor:
    assert o.finish_reason == "stop" and o.new_token_ids == [] and o.pooled is not None, o
    return torch.from_numpy(np.frombuffer(o.pooled.data, dtype="<f4").reshape(o.pooled.shape).copy())


def run(core: EngineCore, prompts: list[list[int]]) -> list[RequestOutput]:
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


def reference(hidden: torch.Tensor, prompt: list[int], pooling: str, step_tag: int) -> torch.Tensor:
    if pooling == "LAST":
        return hidden[-1]
    if pooling == "CLS":
        return hidden[0]
    if pooling == "MEAN":
        return hidden.mean(dim=0)
    if pooling == "STEP":
        return hidden[torch.tensor(prompt) == step_tag]
    return hidden


CASES = {
    "single": ([37], {}),
    "batched": ([5, 1, 23, 64, 17], {}),
    "chunked_prefill": ([100, 9, 70], dict(max_num_batched_tokens=16)),
    "shared_prefix": ([3, 20, 1], dict(block_size=8)),  # 40 shared tokens: only LAST may reuse them
}


@pytest.mark.parametrize("pooling", ["LAST", "CLS", "MEAN", "ALL", "STEP"])
@pytest.mark.parametrize("case", CASES)
def test_every_pooler_matches_transformers(qwen2_ckpt: Path, pooling: str, case: str) -> None:
    lengths, kw = CASES[case]
    overrides: dict[str, object] = {"pooling_type": pooling}
    prompts = make_prompts(151_646, lengths, shared=40 if case == "shared_prefix" else 0)
    step_tag = prompts[0][0]
    if pooling == "STEP":
        overrides["step_tag_id"] = step_tag
        for p in prompts:  # the tag at a few places in each prompt
            p[::3] = [step_tag] * len(p[::3])
    core = EngineCore(
        EngineConfig(model=str(qwen2_ckpt), runner="pooling", pooler_config=overrides, **{"num_blocks": 64, **kw})
    )  # type: ignore[arg-type]
    for prompt, out in zip(prompts, run(core, prompts)):
        expected = reference(hf_hidden(qwen2_ckpt, prompt), prompt, pooling, step_tag)
        torch.testing.assert_close(pooled(out), expected, atol=1e-4, rtol=1e-4)
    assert core.block_manager.num_used_blocks == 0  # no KV kept after the requests
    assert core.pooler is not None and core.pooler.num_partial == 0
    if case == "shared_prefix":  # the others read every position: no prefix-cache hit may skip one
        assert (core.block_manager.prefix_cache_hits > 0) == (pooling == "LAST")


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("case", ["batched", "chunked_prefill"])
def test_classifier_logits_match_transformers(request: pytest.FixtureRequest, arch: str, case: str) -> None:
    ckpt: Path = request.getfixturevalue(f"{arch}_cls_ckpt")
    lengths, kw = CASES[case]
    core = EngineCore(EngineConfig(model=str(ckpt), runner="pooling", num_blocks=64, **kw))  # type: ignore[arg-type]
    info = core.ready_message().pooling
    assert info is not None and info.task == "classify" and info.pooling_type == "LAST"
    assert info.labels == ["label_a", "label_b", "label_c"][: 3 if arch == "qwen2" else 2]
    assert info.activation == "softmax"
    # no pad id in a prompt (Qwen2 151643, Llama 0): transformers pools at the last token that is not padding
    prompts = [[t or 1 for t in p] for p in make_prompts(151_643 if arch == "qwen2" else 32_000, lengths, seed=3)]
    for prompt, out in zip(prompts, run(core, prompts)):
        torch.testing.assert_close(pooled(out), hf_hidden(ckpt, prompt, classify=True), atol=1e-4, rtol=1e-4)


def test_convert_embed_on_a_classifier_and_classify_refused_without_a_head(
    qwen2_cls_ckpt: Path, qwen2_ckpt: Path
) -> None:
    core = EngineCore(EngineConfig(model=str(qwen2_cls_ckpt), runner="pooling", convert="embed", num_blocks=8))
    info = core.ready_message().pooling
    assert info is not None and info.task == "embed" and info.normalize
    (out,) = run(core, [[1, 2, 3]])
    torch.testing.assert_close(pooled(out), hf_hidden(qwen2_cls_ckpt, [1, 2, 3])[-1], atol=1e-4, rtol=1e-4)
    with pytest.raises(ModelLoadError, match="ForSequenceClassification"):
        EngineCore(EngineConfig(model=str(qwen2_ckpt), runner="pooling", convert="classify", num_blocks=8))
    with pytest.raises(ModelLoadError, match="--runner pooling"):  # no LM head: it cannot generate
        EngineCore(EngineConfig(model=str(qwen2_cls_ckpt), num_blocks=8))


def test_sentence_transformers_layout(st_mean_ckpt: Path) -> None:
    """modules.json + 1_Pooling (mean) + Normalize + prompts, weights saved as Qwen2Model (no "model." prefix)."""
    from sentence_transformers import SentenceTransformer

    core = EngineCore(EngineConfig(model=str(st_mean_ckpt), runner="pooling", num_blocks=64, max_num_batched_tokens=8))
    info = core.ready_message().pooling
    assert info is not None and (info.task, info.pooling_type, info.normalize) == ("embed", "MEAN", True)
    assert info.prompts == {"query": "query: ", "document": "passage: "} and info.default_prompt_name is None
    st = SentenceTransformer(str(st_mean_ckpt), device="cpu")
    texts = ["hello world", "a longer sentence that spans several chunks of eight tokens each, at least"]
    prompts = [st.tokenizer("query: " + t)["input_ids"] for t in texts]
    expected = st.encode(texts, prompt_name="query", convert_to_tensor=True)
    for out, e in zip(run(core, prompts), expected):
        v = pooled(out)
        torch.testing.assert_close(v / v.norm(), e, atol=1e-5, rtol=1e-4)


def test_unnormalized_and_full_context(llama_ckpt: Path) -> None:
    core = EngineCore(
        EngineConfig(
            model=str(llama_ckpt), runner="pooling", pooler_config={"normalize": False}, max_model_len=64, num_blocks=8
        )
    )
    prompts = make_prompts(core.vocab_size, [64, 3])  # a prompt may fill the whole context: no output token
    for prompt, out in zip(prompts, run(core, prompts)):
        torch.testing.assert_close(pooled(out), hf_hidden(llama_ckpt, prompt)[-1], atol=1e-4, rtol=1e-4)
    info = core.ready_message().pooling
    assert info is not None and info.hidden_size == 64 and not info.normalize and not info.is_matryoshka


def test_returned_token_ids_pick_columns(qwen2_ckpt: Path) -> None:
    core = EngineCore(
        EngineConfig(
            model=str(qwen2_ckpt),
            runner="pooling",
            num_blocks=8,
            pooler_config={"pooling_type": "STEP", "returned_token_ids": [3, 0, 63]},
        )
    )
    (out,) = run(core, [[5, 6, 7]])
    torch.testing.assert_close(pooled(out), hf_hidden(qwen2_ckpt, [5, 6, 7])[:, [3, 0, 63]], atol=1e-4, rtol=1e-4)
    with pytest.raises(ModelLoadError, match="below the output width 64"):
        EngineCore(
            EngineConfig(
                model=str(qwen2_ckpt),
                runner="pooling",
                num_blocks=8,
                pooler_config={"pooling_type": "STEP", "returned_token_ids": [64]},
            )
        )


@pytest.mark.parametrize("pooling", ["MEAN", "ALL"])
def test_abort_mid_prompt_frees_everything(qwen2_ckpt: Path, pooling: str) -> None:
    core = EngineCore(
        EngineConfig(
            model=str(qwen2_ckpt),
            runner="pooling",
            pooler_config={"pooling_type": pooling},
            max_num_batched_tokens=8,
            num_blocks=64,
        )
    )
    core.add_request(AddRequest("a", list(range(1, 40)), SamplingParams(max_tokens=1), arrival_time=0.0))
    core.step()
    assert core.pooler is not None and core.pooler.num_partial == 1
    core.abort(["a"])
    (out,) = core.step()
    assert out.finish_reason == "abort" and out.pooled is None
    assert core.block_manager.num_used_blocks == 0 and core.pooler.num_partial == 0


def test_too_long_is_refused(qwen2_ckpt: Path) -> None:
    core = EngineCore(EngineConfig(model=str(qwen2_ckpt), runner="pooling", max_model_len=16, num_blocks=8))
    core.add_request(AddRequest("a", list(range(1, 18)), SamplingParams(max_tokens=1), arrival_time=0.0))
    (out,) = core.step()
    assert out.finish_reason == "error" and "16" in (out.error or "")


def test_pooler_rejects_unknown_type() -> None:
    with pytest.raises(ValueError):
        Pooler("MAX")
    with pytest.raises(ValueError, match="pooling_type"):
        EngineConfig(model="x", runner="pooling", pooler_config={"pooling_type": "MAX"})


def _array(p: PooledData) -> list[list[float]]:
    out: list[list[float]] = np.frombuffer(p.data, dtype="<f4").reshape(p.shape).tolist()
    return out


@pytest.mark.parametrize(
    "pooling, expected_a", [("MEAN", [4.5, 4.5]), ("CLS", [0.0, 0.0]), ("ALL", [[float(p)] * 2 for p in range(10)])]
)
def test_pooling_survives_a_recompute_and_shares_steps(pooling: str, expected_a: list[object]) -> None:
    """Positions 0..n-1 are taken once each, even when a preempted prompt re-runs chunks already taken."""
    from engine.types.sequence import ScheduledSeq, Sequence

    pooler = Pooler(pooling)
    a = Sequence.new("a", list(range(10)), SamplingParams(max_tokens=0), 0.0)
    b = Sequence.new("b", list(range(3)), SamplingParams(max_tokens=0), 0.0)
    rows = torch.arange(10, dtype=torch.float32)[:, None].repeat(1, 2)  # position p's state is [p, p]

    def step(seq: Sequence, start: int, n: int) -> ScheduledSeq:
        seq.num_computed_tokens = start
        return ScheduledSeq(seq, n)

    assert pooler.pool([step(a, 0, 4)], rows[0:4]) == []
    assert pooler.pool([step(a, 0, 6)], rows[0:6]) == []  # recomputed from 0 after a preemption
    done = pooler.pool([step(b, 0, 3), step(a, 6, 4)], torch.cat([rows[0:3], rows[6:10]]))
    assert [s.request_id for s, _ in done] == ["b", "a"]
    assert _array(done[1][1]) == expected_a
    assert pooler.num_partial == 0
