"""Hybrid recurrent families (LFM2, Qwen3.5, Granite 4.0-H with and without experts) against transformers on tiny
random checkpoints, in float32: greedy tokens through the engine with concurrent sequences, chunked prefill through
the recurrent layers (prompts longer than --max-num-batched-tokens), n = 2 siblings, preemption under a small
cache, and an abort mid-prefill that leaves the state pool empty and a zeroed slot for the next request; the pool's
share of the KV budget; refusals in one line naming the key."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.messages import AddRequest
from engine.models.loader import ModelLoadError
from engine.spec import ngram
from tests.engine.models.hybrid_families import HYBRIDS, build_hybrid, build_plain_draft
from tests.helpers.engine import greedy, hf_greedy, run, tokens

NEW = 8
_rng = random.Random(5)
PROMPTS = [[_rng.randrange(3, 30_000) for _ in range(n)] for n in (50, 36, 9, 42)]
FAMILIES = list(HYBRIDS)


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module", params=FAMILIES)
def ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_hybrid(tmp_path_factory.getbasetemp() / "hybrids", str(request.param))


def core_for(ckpt: Path, **kw: Any) -> EngineCore:
    return EngineCore(EngineConfig(model=str(ckpt), **(dict(num_blocks=128, block_size=4) | kw)))


def pool_empty(core: EngineCore) -> bool:
    bm = core.block_manager
    return bm.state is not None and bm.state.num_used == 0 and bm.num_used_blocks == 0


REGIMES: dict[str, dict[str, Any]] = {
    "concurrent": dict(),
    "chunked_prefill": dict(max_num_batched_tokens=8),  # every prompt but one runs in several chunks
    "preemption": dict(num_blocks=12),  # four 10-token prompts admitted at once outgrow 12 blocks
}


@pytest.mark.parametrize("regime", list(REGIMES))
def test_greedy_matches_transformers(ckpt: Path, regime: str) -> None:
    core = core_for(ckpt, **REGIMES[regime])
    prompts = [p[:10] for p in PROMPTS] if regime == "preemption" else PROMPTS
    outs = run(core, [(f"r{i}", p, greedy(NEW), 0) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        assert tokens(outs[f"r{i}"]) == hf_greedy(ckpt, p, NEW), (regime, i)
    if regime == "preemption":
        assert core.stats().num_preemptions > 0, "the small cache should have forced preemption"
    assert pool_empty(core)


SHARED = PROMPTS[0][:37]
PREFIXED = [SHARED + PROMPTS[1][:5], SHARED + PROMPTS[3][:9], SHARED, SHARED[:20]]


def test_prefix_hits_resume_from_state_snapshots(ckpt: Path) -> None:
    """Snapshots every 8 tokens (two blocks): the second prompt sharing 37 tokens resumes at 32 and, its prompt
    matching cached blocks up to 36, leaves a snapshot at that branch point, where the third resumes (16 for a
    20-token prompt: its last token is always computed); chunks cut at 7 tokens so that points fall inside them."""
    core = core_for(ckpt, max_num_batched_tokens=7, state_snapshot_interval=8)
    pool = core.block_manager.state
    assert pool is not None and pool.interval == 8
    outs = run(core, [(f"r{i}", p, greedy(NEW), 12 * i) for i, p in enumerate(PREFIXED)])
    for i, p in enumerate(PREFIXED):
        assert tokens(outs[f"r{i}"]) == hf_greedy(ckpt, p, NEW), i
    assert [outs[f"r{i}"][-1].num_cached_tokens for i in range(len(PREFIXED))] == [0, 32, 36, 16]
    assert pool_empty(core)


def test_a_200_token_prefix_hits_by_default(ckpt: Path) -> None:
    """Default settings (16-token blocks, snapshots every 64 tokens and at prompt ends and branch points): requests
    sharing a 200-token prefix, each with its own tail, resume at 192 from the second on, with the reference's
    tokens; the hit counters say so."""
    rng = random.Random(9)
    prefix = [rng.randrange(3, 30_000) for _ in range(200)]
    prompts = [prefix + [rng.randrange(3, 30_000) for _ in range(n)] for n in (30, 17, 41)]
    core = EngineCore(EngineConfig(model=str(ckpt)))
    for i, p in enumerate(prompts):
        before = core.stats().prefix_cache_hits
        outs = run(core, [(f"r{i}", p, greedy(4), 0)])
        assert tokens(outs[f"r{i}"]) == hf_greedy(ckpt, p, 4), i
        assert outs[f"r{i}"][-1].num_cached_tokens == (192 if i else 0)
        assert core.stats().prefix_cache_hits - before == (192 if i else 0)
    assert pool_empty(core)


def test_one_snapshot_keeps_the_latest(ckpt: Path) -> None:
    """Room for one snapshot: each new one evicts the last (least recently used), so a 33-token prompt leaves its
    snapshot at 32, which a longer prompt sharing those tokens resumes from; too little room for one: none."""
    assert core_for(ckpt, state_snapshot_memory=1).block_manager.state.interval == 0  # type: ignore[union-attr]
    states = core_for(ckpt).runner.states
    assert states is not None
    per_slot = sum(t[0].numel() * t.element_size() for layer in states.layers for t in layer)
    core = core_for(ckpt, max_num_batched_tokens=7, state_snapshot_interval=8, state_snapshot_memory=per_slot)
    pool = core.block_manager.state
    assert pool is not None and pool.num_snapshots == 1
    longer = SHARED + PROMPTS[1][:5]
    outs = run(core, [("a", SHARED[:33], greedy(1), 0), ("b", longer, greedy(NEW), 12)])
    assert tokens(outs["a"]) == hf_greedy(ckpt, SHARED[:33], 1)
    assert tokens(outs["b"]) == hf_greedy(ckpt, longer, NEW) and outs["b"][-1].num_cached_tokens == 32
    assert pool.num_bound_snapshots == 1 and pool_empty(core)


def test_n2_siblings_each_get_the_reference(ckpt: Path) -> None:
    """n = 2 arrives as two requests with the same prompt in one step: each its own slot, each exact."""
    core = core_for(ckpt, max_num_batched_tokens=16)
    outs = run(core, [("a", PROMPTS[0], greedy(NEW), 0), ("b", PROMPTS[0], greedy(NEW), 0)])
    ref = hf_greedy(ckpt, PROMPTS[0], NEW)
    assert tokens(outs["a"]) == ref and tokens(outs["b"]) == ref
    assert pool_empty(core)


def test_abort_mid_prefill_frees_the_slot_and_the_next_request_starts_clean(ckpt: Path) -> None:
    core = core_for(ckpt, max_num_batched_tokens=8, max_num_seqs=1)
    pool = core.block_manager.state
    assert pool is not None and pool.num_slots == 1  # --num-blocks given: one slot per --max-num-seqs
    core.add_request(AddRequest("x", PROMPTS[3], greedy(NEW), arrival_time=0.0))
    core.step()
    core.step()  # two chunks of the prompt: the slot holds a state mid-prompt
    assert pool.num_used == 1
    core.abort(["x"])
    assert pool_empty(core)
    assert [o.finish_reason for o in core.step()] == ["abort"]
    outs = run(core, [("y", PROMPTS[1], greedy(NEW), 0)])  # the same slot again, from a zeroed state
    assert tokens(outs["y"]) == hf_greedy(ckpt, PROMPTS[1], NEW)
    assert pool_empty(core)


def test_state_pool_comes_out_of_the_kv_budget(ckpt: Path) -> None:
    memory = 1 << 22
    core = core_for(ckpt, num_blocks=None, kv_cache_memory=memory, max_num_seqs=4)
    runner = core.runner
    assert runner.states is not None
    states = runner.states.layers + runner.states.snapshots  # the snapshots: an eighth of the budget by default
    state_bytes = sum(t.numel() * t.element_size() for layer in states for t in layer)
    kv_bytes = runner.kv_cache.numel() * runner.kv_cache.element_size()
    assert runner.states.num_slots == 4 and runner.states.num_snapshots > 0
    assert state_bytes + kv_bytes <= memory
    stats = core.stats()  # the metric's total counts the pool, weighed in blocks
    assert stats.num_total_blocks == runner.num_blocks + 4 * runner.states.slot_blocks
    core.add_request(AddRequest("x", PROMPTS[2], greedy(2), arrival_time=0.0))
    core.step()
    assert core.stats().num_used_blocks == core.block_manager.num_used_blocks + runner.states.slot_blocks
    # speculation: each slot keeps a state per draft token too, out of the same budget and weighed in the metric
    spec = core_for(ckpt, num_blocks=None, kv_cache_memory=memory, max_num_seqs=4, speculative_config=NGRAM)
    s = spec.runner.states
    assert s is not None and s.num_slots == 4 and s.spec[0][0].shape[0] == 4 * 4
    spec_bytes = sum(t.numel() * t.element_size() for layer in s.layers + s.snapshots + s.spec for t in layer)
    assert spec_bytes + spec.runner.kv_cache.numel() * spec.runner.kv_cache.element_size() <= memory
    assert s.slot_blocks >= 5 * runner.states.slot_blocks - 4  # five states a slot, each rounded up alone before
    assert spec.stats().num_total_blocks == spec.runner.num_blocks + 4 * s.slot_blocks


NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.mark.parametrize("regime", ["concurrent", "chunked_prefill"])
def test_speculative_decoding_rolls_the_state_back(ckpt: Path, regime: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """n-gram speculation whose drafts come from transformers' own output with every third token or so off by one
    (so that verifications both accept and reject): the tokens are transformers' greedy ones, snapshots taken
    inside verifications (every 8 tokens) resume a later prompt exactly, and the pool empties."""
    refs = {tuple(p): p + hf_greedy(ckpt, p, 24) for p in PROMPTS}
    rng = random.Random(7)

    def propose(ids: list[int], k: int, n_max: int, n_min: int) -> list[int]:
        ref = next((r for p, r in refs.items() if ids[: len(p)] == list(p) and ids == r[: len(ids)]), None)
        draft = ref[len(ids) : len(ids) + k] if ref is not None else []
        return [t + 1 if rng.random() < 0.3 else t for t in draft]

    monkeypatch.setattr(ngram, "propose", propose)
    core = core_for(ckpt, speculative_config=NGRAM, state_snapshot_interval=8, **REGIMES[regime])
    outs = run(core, [(f"r{i}", p, greedy(24), 2 * i) for i, p in enumerate(PROMPTS)])
    for i, p in enumerate(PROMPTS):
        assert tokens(outs[f"r{i}"]) == refs[tuple(p)][len(p) :], i
    st = core.stats()
    assert 0 < st.spec_num_accepted_tokens < st.spec_num_draft_tokens  # drafts accepted and rejected
    assert len(outs["r0"]) < 24  # verifications emitted several tokens at once
    assert pool_empty(core)
    # prompt + output: a later turn resumes from a snapshot taken after a verification (at 72 = 50 + 24 - 2)
    turn = refs[tuple(PROMPTS[0])] + PROMPTS[2]
    again = run(core, [("t", turn, greedy(4), 0)])
    assert tokens(again["t"]) == hf_greedy(ckpt, turn, 4) and again["t"][-1].num_cached_tokens == 72
    assert pool_empty(core)


def test_a_draft_model_speculates_for_a_hybrid(
    ckpt: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plain tiny Qwen2 drafting for the hybrid (its own cost not weighed): its drafts are rejected, the state
    rolled back each time, and the tokens are transformers'."""
    monkeypatch.setenv("SPINDLE_SPEC_DRAFT_COST", "0")
    draft = build_plain_draft(tmp_path_factory.getbasetemp() / "hybrids")
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    core = core_for(ckpt, speculative_config=spec)
    outs = run(core, [(f"r{i}", p, greedy(12), i) for i, p in enumerate(PROMPTS[:2])])
    for i, p in enumerate(PROMPTS[:2]):
        assert tokens(outs[f"r{i}"]) == hf_greedy(ckpt, p, 12), i
    st = core.stats()
    assert st.spec_num_draft_tokens > st.spec_num_accepted_tokens
    assert pool_empty(core)


def test_a_hybrid_draft_model_is_refused_in_one_line(ckpt: Path) -> None:
    spec = {"method": "draft_model", "model": str(ckpt), "num_speculative_tokens": 3}
    with pytest.raises(ModelLoadError) as e:
        core_for(ckpt, speculative_config=spec)
    assert "the draft model must not be a hybrid recurrent model" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("family", "change", "named"),
    [
        ("lfm2", {"layer_types": ["conv", "mamba", "conv", "conv"]}, "layer_types ['mamba']"),
        ("lfm2", {"conv_L_cache": None}, "conv_L_cache"),
        ("qwen3_5", {"linear_key_head_dim": None}, "linear_key_head_dim"),
        ("qwen3_5", {"attention_bias": True}, "attention_bias=True"),
        ("granite_h", {"position_embedding_type": "alibi"}, "position_embedding_type='alibi'"),
        ("granite_h", {"mamba_d_state": None}, "mamba_d_state"),
    ],
)
def test_a_checkpoint_served_inexactly_is_refused_naming_the_key(
    family: str, change: dict[str, Any], named: str, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    src = build_hybrid(tmp_path_factory.getbasetemp() / "hybrids", family)
    bad = tmp_path / family
    shutil.copytree(src, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg.update(change)
    (bad / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    with pytest.raises(ModelLoadError) as e:
        core_for(bad)
    assert named in str(e.value) and "\n" not in str(e.value)
