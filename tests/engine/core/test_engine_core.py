"""EngineCore in-process: greedy output equals transformers token for token under every scheduling regime."""

from __future__ import annotations

import random
import zlib
from pathlib import Path

import pytest
import torch

from engine.messages import AddRequest, SamplingParams
from tests.helpers.engine import greedy, hf_greedy, hf_model, make_core, run, tokens


def prompts(vocab: int, seed: int, lengths: list[int], shared: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab) for _ in range(shared)]
    return [prefix + [rng.randrange(vocab) for _ in range(n)] for n in lengths]


REGIMES = {
    "together": dict(),
    "chunked_prefill": dict(max_num_batched_tokens=16),
    "preemption": dict(num_blocks=12, block_size=8),
    "no_prefix_cache": dict(enable_prefix_caching=False, max_num_batched_tokens=24),
}
# Mistral's window (8) on every layer releases passed blocks, so 12 blocks no longer run short: fewer, in chunks
WINDOWED_PREEMPTION = dict(num_blocks=6, block_size=8, max_num_batched_tokens=16)


@pytest.mark.parametrize("arch", ["qwen2", "llama", "mistral"])
@pytest.mark.parametrize("regime", list(REGIMES))
def test_greedy_matches_transformers(request: pytest.FixtureRequest, arch: str, regime: str) -> None:
    ckpt: Path = request.getfixturevalue(f"{arch}_ckpt")
    windowed = (arch, regime) == ("mistral", "preemption")
    core = make_core(ckpt, **(WINDOWED_PREEMPTION if windowed else REGIMES[regime]))
    vocab = core.vocab_size
    ps = prompts(vocab, seed=zlib.crc32(f"{arch}-{regime}".encode()), lengths=[3, 17, 33, 9, 26], shared=20)
    n = 12
    # staggered: requests join a running batch at different steps
    reqs = [(f"r{i}", p, greedy(n), 0 if regime == "together" else 2 * i) for i, p in enumerate(ps)]
    outs = run(core, reqs)
    for rid, p, _, _ in reqs:
        assert tokens(outs[rid]) == hf_greedy(ckpt, p, n), (rid, regime)
        assert outs[rid][-1].finish_reason == "length"
    st = core.stats()
    assert st.num_running == 0 and st.num_used_blocks == 0
    if regime == "preemption":
        assert st.num_preemptions > 0, "the tiny cache should have forced preemption"


def test_seeded_sample_is_batch_invariant(qwen2_ckpt: Path) -> None:
    core = make_core(qwen2_ckpt)
    ps = prompts(core.vocab_size, seed=5, lengths=[11] * 32)
    seeded = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=1234)
    alone = tokens(run(core, [("alone", ps[0], seeded, 0)])["alone"])
    others = [
        (f"o{i}", p, SamplingParams(max_tokens=10, temperature=1.0, seed=i if i % 2 else None), 0)
        for i, p in enumerate(ps[1:])
    ]
    batch = run(core, [("in-batch", ps[0], seeded, 0)] + others)
    assert tokens(batch["in-batch"]) == alone
    assert len(alone) == 10


def test_abort_100_running_returns_every_block(qwen2_ckpt: Path) -> None:
    core = make_core(qwen2_ckpt, num_blocks=1024)
    ps = prompts(core.vocab_size, seed=9, lengths=[random.Random(i).randrange(5, 60) for i in range(100)])
    for i, p in enumerate(ps):
        core.add_request(AddRequest(f"a{i}", p, greedy(200), 0.0))
    for _ in range(3):
        core.step()
    assert core.stats().num_used_blocks > 0
    core.abort([f"a{i}" for i in range(100)])
    outs = core.step()
    assert sorted(o.request_id for o in outs if o.finish_reason == "abort") == sorted(f"a{i}" for i in range(100))
    st = core.stats()
    assert (st.num_running, st.num_waiting, st.num_used_blocks) == (0, 0, 0)
    assert not core.has_work


def test_repeated_512_token_prompt_hits_prefix_cache(qwen2_ckpt: Path) -> None:
    core = make_core(qwen2_ckpt, num_blocks=200)
    p = prompts(core.vocab_size, seed=3, lengths=[512])[0]
    first = run(core, [("first", p, greedy(2), 0)])["first"]
    second = run(core, [("second", p, greedy(2), 0)])["second"]
    assert first[0].num_cached_tokens == 0
    assert second[0].num_cached_tokens >= 496
    assert tokens(first) == tokens(second)


def test_stop_token_ids_min_tokens_and_eos(qwen2_ckpt: Path) -> None:
    core = make_core(qwen2_ckpt)
    p = prompts(core.vocab_size, seed=4, lengths=[10])[0]
    free = tokens(run(core, [("free", p, greedy(8), 0)])["free"])
    # stop on the 3rd greedy token (not seen earlier in the output)
    stop_at = next(i for i in range(2, 8) if free[i] not in free[:i])
    params = SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[free[stop_at]])
    outs = run(core, [("s", p, params, 0)])["s"]
    assert tokens(outs) == free[: stop_at + 1]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_token_id == free[stop_at]
    # min_tokens holds the stop id back: generation goes past it
    held = SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[free[0]], min_tokens=3)
    got = tokens(run(core, [("m", p, held, 0)])["m"])
    assert len(got) >= 3 and free[0] not in got[:3]


@pytest.mark.parametrize(
    "bad",
    [
        dict(prompt=[], why="empty"),
        dict(prompt=[10**9], why="vocabulary"),
        dict(prompt=[-1], why="vocabulary"),
        dict(params=SamplingParams(max_tokens=10**7), why="max"),
        dict(params=SamplingParams(max_tokens=1, temperature=float("nan")), why="finite"),
        dict(params=SamplingParams(max_tokens=1, stop_token_ids=[10**9]), why="vocabulary"),
    ],
)
def test_impossible_requests_are_refused_not_crashes(qwen2_ckpt: Path, bad: dict) -> None:  # type: ignore[type-arg]
    core = make_core(qwen2_ckpt)
    prompt = bad.get("prompt", [1, 2, 3])
    params = bad.get("params", greedy(2))
    outs = run(core, [("bad", prompt, params, 0), ("good", [1, 2, 3], greedy(2), 0)])
    assert outs["bad"][-1].finish_reason == "error" and outs["bad"][-1].error
    assert len(tokens(outs["good"])) == 2


def test_huge_top_k_and_extreme_bias_do_not_crash(qwen2_ckpt: Path) -> None:
    core = make_core(qwen2_ckpt)
    params = SamplingParams(max_tokens=3, temperature=0.7, top_k=10**9, logit_bias={5: 100.0}, seed=1)
    outs = run(core, [("k", [1, 2, 3], params, 0)])
    assert tokens(outs["k"]) == [5, 5, 5]


@pytest.mark.parametrize("regime", ["together", "chunked_prefill"])
def test_prompt_and_sample_logprobs_match_transformers(qwen2_ckpt: Path, regime: str) -> None:
    core = make_core(qwen2_ckpt, **REGIMES[regime])
    p = prompts(core.vocab_size, seed=11, lengths=[40])[0]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    outs = run(core, [("lp", p, params, 0)])["lp"]
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(qwen2_ckpt)(torch.tensor([p + tokens(outs)])).logits[0].float(), -1)
    plp = outs[0].prompt_logprobs
    assert plp is not None and len(plp) == len(p) and plp[0] is None
    for k in range(1, len(p)):
        e = plp[k]
        assert e is not None and e.token_id == p[k]
        assert e.logprob == pytest.approx(ref[k - 1, p[k]].item(), abs=1e-3)
        assert e.top_ids == ref[k - 1].topk(2).indices.tolist()
    for i, o in enumerate(outs):
        assert o.logprobs is not None
        e = o.logprobs[0]
        pos = len(p) - 1 + i
        assert e.token_id == o.new_token_ids[0] and e.rank == 1
        assert e.logprob == pytest.approx(ref[pos].max().item(), abs=1e-3)


def test_siblings_admitted_in_one_step_share_the_prompt(qwen2_ckpt: Path) -> None:
    """n > 1: children that arrive together compute their shared prompt once, and stay correct."""
    core = make_core(qwen2_ckpt)
    p = prompts(core.vocab_size, seed=21, lengths=[70])[0]
    outs = run(core, [(f"c{i}", p, greedy(4), 0) for i in range(4)])
    cached = sorted(outs[f"c{i}"][0].num_cached_tokens for i in range(4))
    assert cached == [0, 64, 64, 64]
    ref = hf_greedy(qwen2_ckpt, p, 4)
    assert all(tokens(outs[f"c{i}"]) == ref for i in range(4))


def test_chunked_siblings_share_only_computed_blocks(qwen2_ckpt: Path) -> None:
    # a 16-token budget: the first child's chunk covers one block; the rest wait and hit what exists
    core = make_core(qwen2_ckpt, max_num_batched_tokens=16)
    p = prompts(core.vocab_size, seed=22, lengths=[40])[0]
    outs = run(core, [(f"k{i}", p, greedy(3), 0) for i in range(3)])
    ref = hf_greedy(qwen2_ckpt, p, 3)
    assert all(tokens(outs[f"k{i}"]) == ref for i in range(3))


def test_step_of_only_mid_prompt_chunks_samples_nothing(qwen2_ckpt: Path) -> None:
    """A step whose every row is a prefill chunk that ends mid-prompt computes no logits (it crashed the
    LM head's chunking before: a long prompt under a small token budget, nothing decoding beside it)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the LM head's threaded path, as in the server's engine process
    try:
        core = make_core(qwen2_ckpt, max_num_batched_tokens=64)
        assert core.runner.head_workers == 2
        prompt = prompts(core.vocab_size, seed=3, lengths=[300])[0]
        outs = run(core, [("long", prompt, greedy(3), 0)])
    finally:
        torch.set_num_threads(threads)
    assert tokens(outs["long"]) == hf_greedy(qwen2_ckpt, prompt, 3)
    assert outs["long"][-1].finish_reason == "length"
