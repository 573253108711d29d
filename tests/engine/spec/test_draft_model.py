"""Speculative decoding with a draft model in an in-process EngineCore: output identical to plain decoding, a
model drafting for itself accepts nearly everything, the draft's blocks come back, bad drafts stop start-up."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from engine.core.engine_core import EngineCore
from engine.execution.sampler import Sampler
from engine.messages import AddRequest, SamplingParams
from engine.models.weights import ModelLoadError
from engine.spec.draft_model import DraftModel
from engine.spec.verify import sampled_rows, verify
from engine.types.sequence import ScheduledSeq, Sequence
from tests.helpers.engine import greedy, make_core, run, tokens

pytestmark = pytest.mark.usefixtures("free_draft")  # these check what the draft path emits, not its cost
REGIMES = {
    "together": dict(),
    "chunked_prefill": dict(max_num_batched_tokens=16),
    "preemption": dict(num_blocks=14, block_size=8),
}


def draft_config(model: Path, k: int = 4) -> dict[str, object]:
    return {"model": str(model), "num_speculative_tokens": k}


def drafter(core: EngineCore) -> DraftModel:
    assert core.spec is not None and core.spec.drafter is not None
    return core.spec.drafter


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("regime", list(REGIMES))
def test_greedy_identical_with_a_noisy_draft(qwen2_ckpt: Path, noisy_draft: Path, regime: str) -> None:
    reqs = [(f"r{i}", p, greedy(24), 2 * i) for i, p in enumerate(prompts(len(regime), [3, 17, 30, 9]))]
    want = {rid: tokens(o) for rid, o in run(make_core(qwen2_ckpt, **REGIMES[regime]), reqs).items()}
    spec = make_core(qwen2_ckpt, speculative_config=draft_config(noisy_draft), **REGIMES[regime])
    outs = run(spec, reqs)
    for rid, *_ in reqs:
        assert tokens(outs[rid]) == want[rid], rid
        assert outs[rid][-1].finish_reason == "length"
    st = spec.stats()
    assert st.num_used_blocks == 0 and st.num_running == 0
    assert 0 < st.spec_num_accepted_tokens < st.spec_num_draft_tokens  # both accepted and rejected tokens
    spec.step()  # nothing left to run: the finished sequences' draft blocks go back
    assert drafter(spec).num_free_blocks == drafter(spec).runner.num_blocks and not drafter(spec).shadows


def test_self_draft_accepts_nearly_every_token(qwen2_ckpt: Path) -> None:
    """Penalties and logit bias apply to the draft's pick as to the target's greedy row."""
    penalized = SamplingParams(
        max_tokens=32,
        temperature=0.0,
        ignore_eos=True,
        repetition_penalty=1.3,
        frequency_penalty=0.4,
        logit_bias={9: 4.0},
    )
    reqs = [(f"r{i}", p, greedy(32), 0) for i, p in enumerate(prompts(5, [4, 11, 23]))]
    reqs.append(("pen", prompts(6, [9])[0], penalized, 0))
    want = {rid: tokens(o) for rid, o in run(make_core(qwen2_ckpt), reqs).items()}
    spec = make_core(qwen2_ckpt, speculative_config=draft_config(qwen2_ckpt, 5))
    outs = run(spec, reqs)
    assert {rid: tokens(o) for rid, o in outs.items()} == want
    st = spec.stats()
    assert st.spec_num_draft_tokens >= 20
    assert st.spec_num_accepted_tokens / st.spec_num_draft_tokens >= 0.9, st
    assert len(outs["r0"]) < 32  # verifications emitted several tokens each


def test_n_and_sampled_requests_beside_greedy(qwen2_ckpt: Path, noisy_draft: Path) -> None:
    """Seeded sampling stays reproducible; several greedy copies of one prompt (n > 1) each stay exact."""
    p = prompts(9, [12])[0]
    seeded = SamplingParams(max_tokens=20, temperature=0.8, seed=4, ignore_eos=True, logprobs=1)
    reqs = [("a", p, greedy(20), 0), ("b", p, greedy(20), 0), ("c", p, greedy(20), 3), ("s", p, seeded, 0)]
    plain = run(make_core(qwen2_ckpt), reqs)
    spec = make_core(qwen2_ckpt, speculative_config=draft_config(noisy_draft, 3))
    outs = run(spec, reqs)
    assert {r: tokens(o) for r, o in outs.items()} == {r: tokens(o) for r, o in plain.items()}
    want = [lp.token_id for o in plain["s"] for lp in o.logprobs or []]
    assert [lp.token_id for o in outs["s"] for lp in o.logprobs or []] == want
    assert spec.stats().spec_num_accepted_tokens > 0


def test_abort_between_proposal_and_verification(qwen2_ckpt: Path, noisy_draft: Path) -> None:
    """A request aborted while it holds a draft: the others stay exact and its draft blocks come back."""
    ps = prompts(3, [10, 14])
    want = {rid: tokens(o) for rid, o in run(make_core(qwen2_ckpt), [("keep", ps[0], greedy(30), 0)]).items()}
    spec = make_core(qwen2_ckpt, speculative_config=draft_config(noisy_draft))
    spec.add_request(AddRequest("keep", ps[0], greedy(30), 0.0))
    spec.add_request(AddRequest("drop", ps[1], greedy(30), 0.0))
    got: list[int] = []
    aborted = False
    while spec.has_work:
        for o in spec.step():
            got += o.new_token_ids if o.request_id == "keep" else []
        gone = next((s for s in spec.scheduler.running if s.request_id == "drop"), None)
        if not aborted and gone is not None and gone in drafter(spec).shadows:
            spec.abort(["drop"])
            aborted = True
    assert aborted and got == want["keep"]
    spec.step()
    assert drafter(spec).num_free_blocks == drafter(spec).runner.num_blocks


def test_a_full_draft_cache_drafts_nothing(qwen2_ckpt: Path) -> None:
    """Sequences that find no free draft block decode plainly (and exactly)."""
    reqs = [(f"r{i}", p, greedy(16), 0) for i, p in enumerate(prompts(8, [20, 20, 20]))]
    want = {rid: tokens(o) for rid, o in run(make_core(qwen2_ckpt), reqs).items()}
    spec = make_core(qwen2_ckpt, speculative_config=draft_config(qwen2_ckpt))
    drafter(spec).free = drafter(spec).free[:3]  # room for one sequence of 20 + 16 tokens, blocks of 16
    assert {rid: tokens(o) for rid, o in run(spec, reqs).items()} == want
    assert spec.stats().spec_num_draft_tokens > 0


def test_vocabulary_mismatch_stops_start_up(qwen2_ckpt: Path, llama_ckpt: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError) as e:
        make_core(qwen2_ckpt, speculative_config=draft_config(llama_ckpt))
    msg = str(e.value)
    assert "--speculative-config" in msg and "vocabulary does not match" in msg and "\n" not in msg
    assert "tokens" in msg  # the tokenizers' sizes differ
    renamed = tmp_path / "renamed"
    shutil.copytree(qwen2_ckpt, renamed)
    tok = json.loads((renamed / "tokenizer.json").read_text())
    special = next(t for t in tok["added_tokens"] if t["special"])
    special["content"] = special["content"] + "x"
    (renamed / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ModelLoadError, match="special token"):
        make_core(qwen2_ckpt, speculative_config=draft_config(renamed))


def test_missing_draft_stops_start_up(qwen2_ckpt: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        make_core(qwen2_ckpt, speculative_config=draft_config(tmp_path / "nothing"))


def test_one_hot_draft_is_accepted_with_the_target_probability() -> None:
    """A greedy draft's q is one-hot: the draft token is accepted with probability p(token)."""
    torch.manual_seed(1)
    logits = torch.tensor([[0.5, 1.5, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0]])
    params = SamplingParams(max_tokens=4, temperature=1.0)
    sampler = Sampler(4, [], torch.device("cpu"))
    draws, accepted = 4000, 0
    for _ in range(draws):
        seq = Sequence.new("r", [2, 3], params, 0.0)
        seq.num_computed_tokens = 1
        seq.draft = [1]
        [(_, emitted, _)] = verify(sampler, logits.clone(), sampled_rows([ScheduledSeq(seq, 2, 1)]))
        accepted += len(emitted) == 2
    p = float(torch.softmax(logits[0], -1)[1])
    sd = (p * (1 - p) / draws) ** 0.5
    assert abs(accepted / draws - p) < 4 * sd


def test_catch_up_proposes_as_a_fresh_draft(qwen2_ckpt: Path, noisy_draft: Path) -> None:
    """After a verification (some draft tokens accepted, then a token of the target's), the cached draft
    proposes exactly what a draft with an empty cache proposes for the same tokens."""
    cached = drafter(make_core(qwen2_ckpt, speculative_config=draft_config(noisy_draft)))
    fresh = drafter(make_core(qwen2_ckpt, speculative_config=draft_config(noisy_draft)))
    for accepted in (0, 2, 4, 4, 1):
        seq = Sequence.new("s", prompts(accepted, [13])[0], greedy(40), 0.0)
        for _ in range(3):
            cached.propose([(seq, 4)])
            bonus = (seq.draft[accepted] + 1) % 1000 if accepted < 4 else 7
            seq.token_ids += seq.draft[:accepted] + [bonus]
            cached.propose([(seq, 4)])
            again = Sequence.new("s", list(seq.token_ids), greedy(40), 0.0)
            fresh.propose([(again, 4)])
            fresh.retain(set())
            assert seq.draft == again.draft, accepted
        cached.retain(set())
    assert cached.num_free_blocks == cached.runner.num_blocks


def test_gguf_target_and_draft(tmp_path: Path) -> None:
    """GGUF files load as target and draft: a Q8_0 copy drafting for its float original."""
    import gguf

    from tests.engine.gguf.files import write_llama

    write_llama(tmp_path / "f32.gguf")
    write_llama(tmp_path / "q8.gguf", qtype=gguf.GGMLQuantizationType.Q8_0)
    target = tmp_path / "f32.gguf"
    rng = random.Random(4)
    reqs = [(f"r{i}", [rng.randrange(90) for _ in range(n)], greedy(24), 0) for i, n in enumerate([5, 12])]
    want = {rid: tokens(o) for rid, o in run(make_core(target), reqs).items()}
    spec = make_core(target, speculative_config=draft_config(tmp_path / "q8.gguf"))
    assert {rid: tokens(o) for rid, o in run(spec, reqs).items()} == want
    st = spec.stats()
    assert st.spec_num_accepted_tokens / max(st.spec_num_draft_tokens, 1) >= 0.5, st
