"""Sampler: exactness of the drawn distribution (chi-square against a float64 reference),
logits processing against straightforward per-token references, seeds, logprobs, NaN rows."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch

import engine.execution.sampler as sampler_mod
from engine.execution.sampler import Sampler
from engine.messages import SamplingParams
from engine.types.sequence import Sequence

EOS = 3


def seq(
    params: SamplingParams, prompt: list[int] | None = None, output: list[int] | None = None, rid: str = "r"
) -> Sequence:
    s = Sequence.new(rid, prompt or [0], params, 0.0)
    s.token_ids += output or []
    return s


def sampler(V: int) -> Sampler:
    return Sampler(V, [EOS], torch.device("cpu"))


def reference_probs(logits: list[float], p: SamplingParams) -> list[float]:
    """Temperature -> min_p -> top_k -> top_p, in float64, by sorting: the textbook way."""
    x = torch.tensor(logits, dtype=torch.float64) / p.temperature
    probs = torch.softmax(x, -1)
    keep = probs >= p.min_p * probs.max()
    order = torch.argsort(probs, descending=True)
    if 0 < p.top_k < len(logits):
        keep[order[p.top_k :]] = False
    probs = torch.where(keep, probs, 0.0)
    probs /= probs.sum()
    mass = 0.0
    for i in order.tolist():  # nucleus: tokens whose more likely predecessors hold < top_p
        if probs[i] > 0 and mass >= p.top_p:
            probs[i] = 0.0
        mass += float(probs[i])
    return (probs / probs.sum()).tolist()


def chi_square_ok(counts: list[int], expected: list[float], n: int) -> None:
    df = -1
    stat = 0.0
    for c, e in zip(counts, expected):
        if e == 0:
            assert c == 0, "a token outside the allowed set was drawn"
        else:
            stat += (c - n * e) ** 2 / (n * e)
            df += 1
    if df == 0:
        return
    z = 3.72  # p = 1e-4, Wilson-Hilferty approximation of the chi-square quantile
    crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    assert stat < crit, f"chi-square {stat:.1f} >= {crit:.1f} (df {df})"


LOGITS = [2.0, 1.5, 1.2, 0.3, 0.0, -0.4, -1.0, 0.9, 1.7, -2.5, 0.5, 1.0]
COMBOS = [
    SamplingParams(max_tokens=1),
    SamplingParams(max_tokens=1, temperature=0.7),
    SamplingParams(max_tokens=1, temperature=1.3, top_k=4),
    SamplingParams(max_tokens=1, top_p=0.6),
    SamplingParams(max_tokens=1, temperature=0.8, top_p=0.3),
    SamplingParams(max_tokens=1, min_p=0.2),
    SamplingParams(max_tokens=1, top_k=6, top_p=0.8, min_p=0.1),
    SamplingParams(max_tokens=1, top_k=100, top_p=0.9),  # huge top_k: off
]


@pytest.mark.parametrize("params", COMBOS, ids=lambda p: msgspec.json.encode(p).decode()[16:-1])
@pytest.mark.parametrize("path", ["default", "blocked", "large-k", "fallback-candidates", "fallback-sort"])
def test_distribution_matches_reference(params: SamplingParams, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if path == "blocked":  # the two-level inverse CDF, with a short last block (12 = 5 + 5 + 2)
        monkeypatch.setattr(sampler_mod, "ARGMAX_CHUNK", 5)
    if path == "large-k":  # top_k beyond the candidate limit: threshold mask on the full row
        monkeypatch.setattr(sampler_mod, "MAX_CANDIDATES", 2)
    if path.startswith("fallback"):  # top_p: the first candidates too few for the nucleus
        monkeypatch.setattr(sampler_mod, "FIRST_CANDIDATES", 1)
    if path == "fallback-sort":  # ... and the wider candidates too: full sort
        monkeypatch.setattr(sampler_mod, "MAX_CANDIDATES", 1)
    torch.manual_seed(1234)
    n = 20_000
    logits = torch.tensor([LOGITS] * n)
    out = sampler(len(LOGITS)).sample(logits, [seq(params)] * n)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=len(LOGITS)).tolist()
    chi_square_ok(counts, reference_probs(LOGITS, params), n)


def test_distribution_check_can_fail() -> None:
    counts = [0] * len(LOGITS)
    counts[0] = 1000
    with pytest.raises(AssertionError):
        chi_square_ok(counts, reference_probs(LOGITS, SamplingParams(max_tokens=1)), 1000)


def test_greedy_is_argmax_and_mixed_batches_keep_it() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    s = sampler(50)
    assert s.sample(logits, [seq(greedy)] * 6).token_ids == logits.argmax(-1).tolist()
    mixed = [
        seq(greedy),
        seq(SamplingParams(max_tokens=1)),
        seq(greedy),
        seq(SamplingParams(max_tokens=1, top_k=3)),
        seq(greedy),
        seq(SamplingParams(max_tokens=1, top_p=0.5)),
    ]
    out = s.sample(logits, mixed).token_ids
    assert [out[i] for i in (0, 2, 4)] == logits.argmax(-1)[[0, 2, 4]].tolist()


@pytest.mark.parametrize("V", [7, 1024, 1025, 3000, 151_646])
def test_blocked_argmax_equals_torch_argmax(V: int) -> None:
    """The two-level argmax: first maximal column, ties across and inside blocks, a short last block."""
    torch.manual_seed(V)
    x = torch.randn(6, V)
    x[1, :] = 0.0  # all tied: column 0
    x[2, V // 2 :] = x[2].max() + 1  # tie spanning blocks: the first one wins
    x[3, -1] = 1e9  # in the short last block
    x[4, :] = -math.inf  # nothing finite: argmax says column 0
    x[4, V // 3] = -1e30
    x[5, : V - 1] = -math.inf
    assert sampler_mod._argmax(x).tolist() == x.argmax(-1).tolist()
    assert sampler_mod._argmax(x[::2]).tolist() == x[::2].argmax(-1).tolist()
    s = sampler(V)
    assert s.sample(x, [seq(SamplingParams(max_tokens=1, temperature=0.0))] * 6).token_ids == x.argmax(-1).tolist()


def reference_process(logits: list[float], s: Sequence, eos: list[int]) -> list[float]:
    """Per-token loops: allowed ids, logit_bias, min_tokens, repetition (HF), frequency, presence."""
    p, x = s.params, list(logits)
    if p.allowed_token_ids:
        x = [v if i in p.allowed_token_ids else -math.inf for i, v in enumerate(x)]
    for i, b in (p.logit_bias or {}).items():
        x[i] += b
    if s.num_output_tokens < p.min_tokens:
        for i in list(p.stop_token_ids) + ([] if p.ignore_eos else eos):
            x[i] = -math.inf
    for i in set(s.token_ids):
        x[i] = x[i] / p.repetition_penalty if x[i] > 0 else x[i] * p.repetition_penalty
    out = s.output_token_ids
    for i in set(out):
        x[i] -= p.frequency_penalty * out.count(i) + p.presence_penalty
    return x


PROCESS_CASES = [
    (SamplingParams(max_tokens=9, repetition_penalty=1.3), [5, 6, 7], [7, 8, 8]),
    (SamplingParams(max_tokens=9, frequency_penalty=0.5, presence_penalty=0.25), [5, 6], [6, 9, 9, 9]),
    (SamplingParams(max_tokens=9, repetition_penalty=0.8, frequency_penalty=-0.3), [1, 2], [2, 2, 11]),
    (SamplingParams(max_tokens=9, logit_bias={4: 5.0, 0: -100.0}), [1], []),
    (SamplingParams(max_tokens=9, allowed_token_ids=[1, 3, 10]), [1], []),
    (SamplingParams(max_tokens=9, min_tokens=2, stop_token_ids=[7]), [1], [2]),
    (SamplingParams(max_tokens=9, min_tokens=2, stop_token_ids=[7], ignore_eos=True), [1], [2]),
    (SamplingParams(max_tokens=9, min_tokens=2, stop_token_ids=[7]), [1], [2, 4]),  # reached
]


def test_processing_matches_per_token_reference() -> None:
    torch.manual_seed(3)
    V = 12
    logits = torch.randn(len(PROCESS_CASES), V) * 2
    seqs = [seq(p, prompt, out, str(i)) for i, (p, prompt, out) in enumerate(PROCESS_CASES)]
    x = logits.clone()
    s = sampler(V)
    s._process(x, seqs, list(range(len(seqs))))
    for row, sq in enumerate(seqs):
        expected = reference_process(logits[row].tolist(), sq, [EOS])
        assert x[row].tolist() == pytest.approx(expected, abs=1e-5), PROCESS_CASES[row]


def test_processing_drives_the_choice() -> None:
    logits = torch.tensor([[4.0, 3.9, 0.0, 3.0, 1.0, 0.0]] * 4)
    g = SamplingParams(max_tokens=5, temperature=0.0)
    seqs = [
        seq(msgspec.structs.replace(g, presence_penalty=0.5), output=[0]),  # 0 penalized: 1 wins
        seq(msgspec.structs.replace(g, allowed_token_ids=[2, 4])),
        seq(msgspec.structs.replace(g, logit_bias={5: 10.0})),
        # contradictory masks: the raw argmax
        seq(msgspec.structs.replace(g, min_tokens=1, allowed_token_ids=[EOS])),
    ]
    assert sampler(6).sample(logits, seqs).token_ids == [1, 4, 5, 0]
    # the engine's path: logits are a scratch buffer; penalties-only batches process them in place
    assert sampler(6).sample(logits.clone(), seqs, scratch=True).token_ids == [1, 4, 5, 0]
    assert sampler(6).sample(logits.clone(), seqs[:1] * 4, scratch=True).token_ids == [1] * 4


def test_eos_masked_until_min_tokens_in_random_sampling() -> None:
    logits = torch.tensor([[0.0, 0.0, 0.0, 20.0]] * 200)
    p = SamplingParams(max_tokens=5, min_tokens=2)
    out = sampler(4).sample(logits, [seq(p, output=[1])] * 200).token_ids
    assert EOS not in out
    out = sampler(4).sample(logits, [seq(p, output=[1, 1])] * 200).token_ids
    assert out.count(EOS) > 190


def test_seeded_request_is_reproducible_alone_and_in_a_batch() -> None:
    V = 1000
    torch.manual_seed(5)
    steps = [torch.randn(32, V) for _ in range(6)]
    target = SamplingParams(max_tokens=6, seed=42, top_p=0.9, temperature=1.2)
    others = [
        SamplingParams(max_tokens=6),
        SamplingParams(max_tokens=6, top_k=20),
        SamplingParams(max_tokens=6, temperature=0.0),
        SamplingParams(max_tokens=6, seed=7),
        SamplingParams(max_tokens=6, top_p=0.5, min_p=0.05),
    ]
    alone, batched = seq(target, rid="a"), seq(target, rid="b")
    batch = [seq(others[i % 5], rid=str(i)) for i in range(31)]
    batch.insert(17, batched)
    s = sampler(V)
    got_alone, got_batched = [], []
    for logits in steps:
        got_alone.append(s.sample(logits[17:18], [alone]).token_ids[0])
        got_batched.append(s.sample(logits, batch).token_ids[17])
        torch.rand(3)  # the global stream moves on between steps: must not matter
    assert got_alone == got_batched
    other_seed = seq(SamplingParams(max_tokens=6, seed=43, top_p=0.9, temperature=1.2), rid="c")
    assert [s.sample(lg[17:18], [other_seed]).token_ids[0] for lg in steps] != got_alone


def test_logprobs_match_log_softmax_of_raw_logits() -> None:
    torch.manual_seed(6)
    V = 40
    logits = torch.randn(3, V) * 3
    params = [
        SamplingParams(max_tokens=1, logprobs=5, presence_penalty=1.0),
        SamplingParams(max_tokens=1, logprobs=0, temperature=0.0),
        SamplingParams(max_tokens=1),
    ]
    out = sampler(V).sample(logits, [seq(p, output=[1, 2]) for p in params])
    ref = torch.log_softmax(logits.double(), -1)
    for row in (0, 1):
        lp = out.logprobs[row]
        assert lp is not None and lp.token_id == out.token_ids[row]
        assert lp.logprob == pytest.approx(ref[row, lp.token_id].item(), abs=1e-4)
        assert lp.rank == int((ref[row] > ref[row, lp.token_id]).sum()) + 1
        n = params[row].logprobs or 0
        assert lp.top_ids == ref[row].topk(n).indices.tolist()
        assert lp.top_logprobs == pytest.approx(ref[row].topk(n).values.tolist(), abs=1e-4)
    assert out.logprobs[1] is not None and out.logprobs[1].rank == 1
    assert out.logprobs[2] is None


def test_prompt_logprobs() -> None:
    torch.manual_seed(7)
    logits = torch.randn(150, 30)  # more positions than one chunk
    targets = [4, 0, 29, 7, 7] * 30
    got = sampler(30).prompt_logprobs(logits, targets, 2)
    ref = torch.log_softmax(logits.double(), -1)
    for t, (lp, target) in enumerate(zip(got, targets)):
        assert lp.token_id == target
        assert lp.logprob == pytest.approx(ref[t, target].item(), abs=1e-4)
        assert lp.rank == int((ref[t] > ref[t, target]).sum()) + 1
        assert lp.top_ids == ref[t].topk(2).indices.tolist()


def test_nan_and_inf_rows_do_not_crash() -> None:
    V = 8
    logits = torch.randn(4, V)
    logits[0] = math.nan  # all NaN
    logits[1, 2] = math.nan  # one NaN: never chosen
    logits[2, 5] = math.inf  # +inf: always chosen
    logits[3] = -math.inf  # nothing finite
    s = sampler(V)
    for params in (
        SamplingParams(max_tokens=1, temperature=0.0),
        SamplingParams(max_tokens=1),
        SamplingParams(max_tokens=1, top_p=0.5, logprobs=2),
    ):
        for _ in range(20):
            out = s.sample(logits, [seq(params)] * 4).token_ids
            assert all(0 <= t < V for t in out)
            assert out[1] != 2 and out[2] == 5


@pytest.mark.skipif(sampler_mod.cpu_argmax._kernel() is None, reason="no AVX-512 CPU kernel here")
def test_greedy_rows_take_the_cpu_argmax_and_bad_rows_the_careful_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """All-greedy float32 logits: one kernel pass picks torch.argmax's tokens, on a padded head's trimmed view
    too; a NaN or +inf row makes the kernel decline and the careful path decides, as before."""
    real, calls = sampler_mod.cpu_argmax.argmax, []

    def counted(x: torch.Tensor, threads: int = 1) -> torch.Tensor | None:
        got = real(x, threads)
        calls.append(got is not None)
        return got

    monkeypatch.setattr(sampler_mod.cpu_argmax, "argmax", counted)
    V, greedy = 3000, SamplingParams(max_tokens=1, temperature=0.0)
    logits = torch.randn(5, V + 64)  # 64 padded columns past the vocabulary
    logits[:, V:] = 100.0
    logits[1, :V] = 0.0  # all tied: column 0
    out = sampler(V).sample(logits, [seq(greedy)] * 5).token_ids
    assert calls == [True] and out == logits[:, :V].argmax(-1).tolist()
    logits[2, 7] = math.nan
    logits[3, 9] = math.inf
    out = sampler(V).sample(logits, [seq(greedy)] * 5).token_ids
    assert calls == [True, False] and out[3] == 9 and out[2] != 7
    assert [out[i] for i in (0, 1, 4)] == logits[[0, 1, 4], :V].argmax(-1).tolist()


def test_fast_path_does_not_modify_logits() -> None:
    logits = torch.randn(4, 20)
    before = logits.clone()
    sampler(20).sample(
        logits, [seq(SamplingParams(max_tokens=1, top_p=0.7, min_p=0.1, presence_penalty=1.0), output=[1])] * 4
    )
    assert torch.equal(logits, before)


def test_padded_vocabulary_columns_are_never_sampled() -> None:
    logits = torch.zeros(50, 10)
    logits[:, 8:] = 5.0  # columns past the tokenizer's vocabulary
    for p in (SamplingParams(max_tokens=1), SamplingParams(max_tokens=1, temperature=0.0)):
        assert max(sampler(8).sample(logits, [seq(p)] * 50).token_ids) < 8


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_grammar_mask_survives_processing(temperature: float) -> None:
    """Constrained decoding bans tokens (-inf) before the sampler: bias, penalties, allowed ids and min_tokens
    never bring one back, a contradiction falls back to the masked row, and logprobs are the allowed ones'."""
    from engine.structured.bitmask import apply_token_bitmask_cpu

    V = 3000
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, V, generator=gen)
    bitmask = torch.zeros(4, (V + 31) // 32, dtype=torch.int32)
    bitmask[:, 3] = 0b1011  # tokens 96, 97, 99 allowed
    apply_token_bitmask_cpu(logits, bitmask, [0, 1, 2, 3])
    cases = [
        SamplingParams(max_tokens=8, temperature=temperature, seed=1, logit_bias={5: 100.0}, logprobs=2),
        SamplingParams(
            max_tokens=8,
            temperature=temperature,
            seed=2,
            repetition_penalty=0.5,
            frequency_penalty=-2.0,
            presence_penalty=-2.0,
        ),
        SamplingParams(max_tokens=8, temperature=temperature, seed=3, allowed_token_ids=[5, 6]),  # disjoint
        SamplingParams(max_tokens=8, temperature=temperature, seed=4, min_tokens=4, stop_token_ids=[97]),
    ]
    seqs = [seq(p, prompt=[5, 6, 7], output=[8, 5]) for p in cases]
    out = sampler(V).sample(logits.clone(), seqs)
    assert all(t in (96, 97, 99) for t in out.token_ids), out.token_ids
    assert out.token_ids[3] != 97  # min_tokens still bans the stop token inside the mask
    lp = out.logprobs[0]
    assert lp is not None and set(lp.top_ids) <= {96, 97, 99} and math.isfinite(lp.logprob)
    allowed = logits[0, [96, 97, 99]]
    assert lp.logprob == pytest.approx(float(allowed[[96, 97, 99].index(lp.token_id)] - allowed.logsumexp(0)), abs=1e-5)


@pytest.mark.parametrize("top_p", [1.0, 0.7])
def test_a_sharp_row_draws_only_what_is_allowed(top_p: float) -> None:
    """At a low temperature most of a row lies below exp's normal range (taken as 0, not worked through slowly):
    a banned (-inf) token, and one ~1e-40 as likely as the top, are never drawn; the two top tokens still are."""
    V = 300
    row = torch.full((V,), -30.0)  # / 0.2 = -150 below the top: under float32's normal range
    row[7], row[8] = 5.0, 4.8  # the top two: 73% and 27% at temperature 0.2 (top_p 0.7 keeps the first alone)
    row[100:200] = -math.inf
    n = 4000
    logits = row.repeat(n, 1)
    torch.manual_seed(7)
    out = sampler(V).sample(logits, [seq(SamplingParams(max_tokens=1, temperature=0.2, top_p=top_p))] * n)
    drawn = set(out.token_ids)
    assert 7 in drawn and drawn <= {7, 8}
    assert (8 in drawn) == (top_p == 1.0)


def test_exp_floored_is_exp_above_the_floor_and_exactly_zero_at_or_below_it() -> None:
    x = torch.tensor([0.0, -1.0, -50.0, -85.5, -86.5, -87.0, -90.0, -104.0, -200.0, -math.inf])
    got = sampler_mod._exp_floored_(x.clone())
    above = x > sampler_mod.EXP_FLOOR + 1.0  # no point within exp's last-bit rounding of the cut
    assert torch.equal(got[above], torch.exp(x[above]))  # bitwise torch's exp where it counts
    assert (got[~above] == 0.0).all()
