"""Speculative decoding in an in-process EngineCore: the output is exactly that of plain decoding.

The drafts come from an oracle (the plain run's own output, some tokens corrupted), so every step both
accepts and rejects draft tokens whatever the random checkpoint writes.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine.core.engine_core import EngineCore
from engine.messages import SamplingParams
from tests.helpers.engine import greedy, make_core, run, tokens

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
REGIMES = {
    "together": dict(),
    "chunked_prefill": dict(max_num_batched_tokens=16),
    "preemption": dict(num_blocks=14, block_size=8),
}


def prompts(vocab: int, seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def reference(
    core: EngineCore, reqs: list[tuple[str, list[int], SamplingParams, int]], refs: dict[tuple[int, ...], list[int]]
) -> dict[str, list[int]]:
    outs = {rid: tokens(o) for rid, o in run(core, reqs).items()}
    for rid, p, _, _ in reqs:
        refs[tuple(p)] = p + outs[rid]
    return outs


@pytest.mark.parametrize("arch", ["qwen2", "llama", "mistral"])
@pytest.mark.parametrize("regime", list(REGIMES))
def test_greedy_identical(
    request: pytest.FixtureRequest, oracle: dict[tuple[int, ...], list[int]], arch: str, regime: str
) -> None:
    ckpt: Path = request.getfixturevalue(f"{arch}_ckpt")
    plain = make_core(ckpt, **REGIMES[regime])
    ps = prompts(plain.vocab_size, seed=len(arch) + len(regime), lengths=[3, 17, 30, 9])
    reqs = [(f"r{i}", p, greedy(24), 2 * i) for i, p in enumerate(ps)]
    want = reference(plain, reqs, oracle)
    spec = make_core(ckpt, speculative_config=NGRAM, **REGIMES[regime])
    outs = run(spec, reqs)
    for rid, *_ in reqs:
        assert tokens(outs[rid]) == want[rid], rid
        assert outs[rid][-1].finish_reason == "length"
    st = spec.stats()
    assert st.num_used_blocks == 0 and st.num_running == 0
    assert 0 < st.spec_num_accepted_tokens < st.spec_num_draft_tokens  # both paths ran
    assert st.spec_accepted_per_pos[0] >= st.spec_accepted_per_pos[-1]
    assert len(outs["r0"]) < 24  # several tokens per output: verification took more than one


def test_prefix_cache_holds_only_accepted_tokens(qwen2_ckpt: Path, oracle: dict[tuple[int, ...], list[int]]) -> None:
    plain = make_core(qwen2_ckpt, block_size=4)
    ps = prompts(plain.vocab_size, seed=3, lengths=[6, 11])
    reqs = [(f"r{i}", p, greedy(30), 0) for i, p in enumerate(ps)]
    want = reference(plain, reqs, oracle)
    spec = make_core(qwen2_ckpt, block_size=4, speculative_config=NGRAM)
    run(spec, reqs)
    bm = spec.block_manager
    texts = [tuple(p + want[rid]) for rid, p, _, _ in reqs]
    for key in bm._cache:  # every cached block is a block of some request's real tokens
        i = next(i for i, t in enumerate(texts) for j in range(0, len(t), 4) if t[j : j + 4] == key[1])
        assert i >= 0
    # a request continuing one of them reads its cached blocks and still decodes exactly
    follow = [("f", list(texts[0][:-3]), greedy(8), 0)]
    assert tokens(run(spec, follow)["f"]) == tokens(run(plain, follow)["f"])
    assert spec.stats().prefix_cache_hits > 0


def test_max_tokens_and_stops_exact(llama_ckpt: Path, oracle: dict[tuple[int, ...], list[int]]) -> None:
    plain = make_core(llama_ckpt)
    p = prompts(plain.vocab_size, seed=11, lengths=[8])[0]
    want = reference(plain, [("long", p, greedy(40), 0)], oracle)["long"]
    stop = want[13]
    first = want.index(stop)
    cases = {
        "max": (SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True), want[:7], "length"),
        "stop": (
            SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop_token_ids=[stop]),
            want[: first + 1],
            "stop",
        ),
        "min": (
            SamplingParams(
                max_tokens=40, temperature=0.0, ignore_eos=True, stop_token_ids=[stop], min_tokens=first + 2
            ),
            None,
            None,
        ),
    }
    spec = make_core(llama_ckpt, speculative_config=NGRAM)
    for name, (params, expect, reason) in cases.items():
        got = run(spec, [(name, p, params, 0)])[name]
        if expect is None:  # min_tokens: the ban on the stop id applies inside the verification too
            expect_outs = run(plain, [(name, p, params, 0)])[name]
            expect, reason = tokens(expect_outs), expect_outs[-1].finish_reason
        assert tokens(got) == expect, name
        assert got[-1].finish_reason == reason, name


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=24, temperature=0.8, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=1.0, top_p=0.7, top_k=50, seed=9, ignore_eos=True),
        SamplingParams(
            max_tokens=24,
            temperature=0.7,
            seed=3,
            ignore_eos=True,
            frequency_penalty=0.5,
            repetition_penalty=1.2,
            logit_bias={5: 3.0},
            logprobs=2,
        ),
    ],
)
def test_seeded_sampling_identical(
    qwen2_ckpt: Path, oracle: dict[tuple[int, ...], list[int]], params: SamplingParams
) -> None:
    plain = make_core(qwen2_ckpt)
    ps = prompts(plain.vocab_size, seed=2, lengths=[5, 12])
    reqs = [(f"s{i}", p, params, 0) for i, p in enumerate(ps)]
    plain_outs = run(plain, reqs)
    for rid, p, _, _ in reqs:
        oracle[tuple(p)] = p + tokens(plain_outs[rid])
    spec = make_core(qwen2_ckpt, speculative_config=NGRAM)
    outs = run(spec, reqs)
    for rid, *_ in reqs:
        assert tokens(outs[rid]) == tokens(plain_outs[rid]), rid
        if params.logprobs:
            lps = [lp for o in outs[rid] for lp in o.logprobs or []]
            want = [lp for o in plain_outs[rid] for lp in o.logprobs or []]
            assert [lp.token_id for lp in lps] == [lp.token_id for lp in want]
            assert [round(lp.logprob, 3) for lp in lps] == [round(lp.logprob, 3) for lp in want]
    assert spec.stats().spec_num_accepted_tokens > 0


def test_constrained_requests_share_the_step(qwen2_ckpt: Path, oracle: dict[tuple[int, ...], list[int]]) -> None:
    """A constrained request runs undrafted beside drafting ones: its grammar mask lands on its own row."""
    from engine.messages import StructuredOutputs
    from tests.engine.structured.conftest import make_core as constrained_core
    from tests.engine.structured.conftest import run as run_constrained

    ps = prompts(1000, seed=4, lengths=[6, 9, 12])
    regex = SamplingParams(max_tokens=20, temperature=0.0, structured_outputs=StructuredOutputs("regex", "[a-z]{3,8}"))
    reqs = [("g1", ps[1], greedy(20)), ("g2", ps[2], greedy(20)), ("c", ps[0], regex)]  # drafts shift c's row
    want = {rid: tokens(o) for rid, o in run_constrained(constrained_core(qwen2_ckpt), reqs).items()}
    for rid, p, _ in reqs:
        oracle[tuple(p)] = p + want[rid]
    spec = constrained_core(qwen2_ckpt, speculative_config=NGRAM)
    outs = run_constrained(spec, reqs)
    assert {rid: tokens(o) for rid, o in outs.items()} == want
    assert outs["c"][-1].finish_reason == "stop" and outs["c"][-1].error is None
    assert spec.stats().spec_num_accepted_tokens > 0


def test_lora_adapters_apply_to_every_verified_row(
    qwen2_ckpt: Path, tmp_path: Path, oracle: dict[tuple[int, ...], list[int]]
) -> None:
    from engine.lora.peft_files import digest
    from engine.messages import AddRequest, LoRARequest
    from tests.helpers.lora import write_adapter

    path = write_adapter(qwen2_ckpt, tmp_path / "a", r=8, targets=["q_proj", "v_proj", "down_proj"], seed=1)
    adapter = LoRARequest("a", str(path), digest(path))
    ps = prompts(1000, seed=6, lengths=[7, 13])

    def outputs(core: EngineCore) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {"base": [], "lora": []}
        core.add_request(AddRequest("base", ps[0], greedy(20), 0.0))
        core.add_request(AddRequest("lora", ps[1], greedy(20), 0.0, lora=adapter))
        while core.has_work:
            for o in core.step():
                assert o.error is None, o.error
                out[o.request_id] += o.new_token_ids
        return out

    want = outputs(make_core(qwen2_ckpt, enable_lora=True))
    oracle[tuple(ps[0])] = ps[0] + want["base"]
    oracle[tuple(ps[1])] = ps[1] + want["lora"]
    spec = make_core(qwen2_ckpt, enable_lora=True, speculative_config=NGRAM)
    assert outputs(spec) == want
    assert spec.stats().spec_num_accepted_tokens > 0
