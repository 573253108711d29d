"""A draft model's own cost in the adaptive policy, on a made-up clock (no timing): a draft as costly as the
target backs off to zero drafted tokens and stays within 5% of plain decoding, a cheap draft with high acceptance
keeps its speed-up; what DraftCost measures; the probe a hopeless draft skips."""

from __future__ import annotations

import random

import pytest

from engine.messages import SamplingParams
from engine.spec.adaptive import DraftCost, StepCost, draft_length, hopeless
from engine.spec.speculator import Speculator
from engine.spec_config import SpecConfig
from engine.types.draft_state import BACKOFF_MIN, DraftState
from engine.types.sequence import SeqStatus, Sequence

PLAIN, JUMP, PER_TOKEN = 1.0, 0.3, 0.05  # made-up seconds of the target's step, as in test_adaptive.py


class FakeDraft:
    """A draft model on the made-up clock: each forward costs `forward` seconds (a catch-up longer than a
    verification costs a tenth of that per token more); its draft tokens are accepted with probability `p`."""

    def __init__(self, forward: float) -> None:
        self.forward, self.seconds = forward, 0.0
        self.seen: dict[Sequence, int] = {}  # tokens the draft's cache holds per sequence

    def retain(self, seqs: set[Sequence]) -> None:
        self.seen = {s: n for s, n in self.seen.items() if s in seqs}

    def propose(self, wanted: list[tuple[Sequence, int]]) -> list[tuple[float, int, int]]:
        chunks = [seq.num_tokens - self.seen.get(seq, 0) for seq, _ in wanted]
        chunk = max(chunks)
        forwards = [(self.forward * (1 + chunk / 10 if chunk > 6 else 1), chunk, sum(chunks))]
        forwards += [(self.forward, 1, len(wanted))] * (max(k for _, k in wanted) - 1)
        for seq, k in wanted:
            seq.draft = [7] * k
            self.seen[seq] = seq.num_tokens + k - 1
        self.seconds += sum(sec for sec, _, _ in forwards)
        return forwards


class Sim:
    """One decoding sequence under the real Speculator with a FakeDraft."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, forward: float, p: float, prompt: int = 100) -> None:
        monkeypatch.delenv("SPINDLE_SPEC_DRAFT_COST", raising=False)
        self.draft = FakeDraft(forward)
        self.spec = Speculator(SpecConfig("draft_model", 5, model="d"), 100_000, self.draft)  # type: ignore[arg-type]
        self.rng, self.p = random.Random(0), p
        self.clock, self.drafted = 0.0, 0
        self.seq = self.new(prompt)

    def new(self, prompt: int) -> Sequence:
        seq = Sequence.new("s", [1] * prompt, SamplingParams(max_tokens=50_000), 0.0)
        seq.status = SeqStatus.RUNNING
        return seq

    def step(self) -> None:
        seq = self.seq
        seq.num_computed_tokens = seq.num_tokens - 1
        before = self.draft.seconds
        self.spec.propose([seq])
        k = len(seq.draft)
        accepted = 0
        while accepted < k and self.rng.random() < self.p:
            accepted += 1
        seconds = PLAIN + (JUMP + PER_TOKEN * k if k else 0.0)
        self.clock += seconds + self.draft.seconds - before
        if k:
            self.spec.record(seq, k, accepted)
            self.drafted += k
        self.spec.record_step(1 + k, k > 0, seconds)
        seq.token_ids += [7] * (accepted + 1)

    def speed(self, tokens: int) -> float:
        """Tokens per made-up second against plain decoding's 1 / PLAIN."""
        start, began = self.seq.num_tokens, self.clock
        while self.seq.num_tokens - start < tokens:
            self.step()
        return (self.seq.num_tokens - start) / (self.clock - began) * PLAIN


def test_a_draft_as_costly_as_the_target_backs_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every token accepted, yet each drafted token costs a plain step: drafting cannot pay."""
    sim = Sim(monkeypatch, forward=PLAIN, p=1.0)
    sim.speed(32)  # the first request: the draft's cost is not known until it has drafted once
    first = sim.drafted
    assert 0 < first <= 5
    for _ in range(3):  # later requests (the cost known): no draft at all, no probe, plain speed
        sim.seq = sim.new(100)
        assert sim.speed(160) >= 0.999
    assert sim.drafted == first
    assert sim.speed(5000) >= 0.999 and sim.drafted == first


def test_the_first_request_stays_within_5_percent(monkeypatch: pytest.MonkeyPatch) -> None:
    sim = Sim(monkeypatch, forward=PLAIN, p=1.0, prompt=20)
    assert sim.speed(160) >= 0.95


def test_a_cheap_draft_with_high_acceptance_keeps_drafting(monkeypatch: pytest.MonkeyPatch) -> None:
    sim = Sim(monkeypatch, forward=0.05 * PLAIN, p=0.9)
    assert sim.speed(1000) >= 2.0
    assert sim.seq.spec.wait == 0 and sim.spec.draft_cost.seconds == pytest.approx(0.05 * PLAIN)


@pytest.mark.parametrize("forward,p", [(0.5, 0.6), (0.3, 0.3), (0.8, 0.95), (0.2, 0.0)])
def test_a_draft_that_does_not_pay_never_slows_decoding(
    monkeypatch: pytest.MonkeyPatch, forward: float, p: float
) -> None:
    sim = Sim(monkeypatch, forward=forward * PLAIN, p=p)
    sim.speed(64)  # the start-up trials
    assert sim.speed(2000) >= 0.95


def test_weighing_off_drafts_whatever_the_draft_costs(monkeypatch: pytest.MonkeyPatch) -> None:
    sim = Sim(monkeypatch, forward=PLAIN, p=1.0)
    monkeypatch.setenv("SPINDLE_SPEC_DRAFT_COST", "0")
    sim.spec = Speculator(SpecConfig("draft_model", 5, model="d"), 100_000, sim.draft)  # type: ignore[arg-type]
    sim.speed(200)
    assert sim.drafted >= 150  # nearly every token drafted (and accepted), slower than plain


def test_draft_cost_counts_steady_forwards_only() -> None:
    cost = DraftCost(most=5)
    assert cost.probes_pay(1.0)  # nothing measured: probe
    cost.record([(0.9, 120, 120), (0.02, 1, 1), (0.02, 1, 1)], drafted=3)  # a prompt's catch-up is not a sample
    assert cost.seconds == pytest.approx(0.02)  # 3 forwards at the steady mean 0.02 over 3 tokens
    assert cost.catch_up == pytest.approx(0.9 / 120)  # what catching up costs per token, apart
    cost.record([(5.0, 300, 300)], drafted=1)  # a probe's long catch-up alone: nothing steady, no sample
    assert cost.seconds == pytest.approx(0.02)
    cost.record([(0.04, 6, 8), (0.04, 1, 2)], drafted=4)  # 2 forwards, 2 sequences drafting 2 each: 0.02 a token
    assert cost.seconds == pytest.approx(0.02)
    cost.record([(0.12, 1, 1)], drafted=1)
    assert cost.seconds == pytest.approx(0.7 * 0.02 + 0.3 * 0.12)
    # catching up costs (0.0075 + 0.0167) / 2 = 0.012 s a token: probes pay against a 1 s step, not a 0.5 s one
    assert cost.probes_pay(1.0) and not cost.probes_pay(0.5)


def test_hopeless_drafts_skip_the_probe() -> None:
    assert hopeless(1.0, 5, 0.0) and hopeless(0.95, 5, 0.3) and not hopeless(0.9, 5, 0.3)
    state = DraftState()
    for _ in range(20):
        state.record(5, 5)  # every token accepted
    assert draft_length(state, 1.05, 5, 0.3) == 0  # each drafted token costs more than a step
    lengths = [draft_length(state, 1.05, 5, 0.3) for _ in range(BACKOFF_MIN * 40)]
    assert not any(lengths) and state.wait > 0  # no probe: it would measure nothing that could change this
    assert state.backoff > BACKOFF_MIN
    lengths = [draft_length(state, 0.2, 5, 0.3) for _ in range(state.wait)]  # cheaper again: the probe comes
    assert lengths[-1] == 1 and not any(lengths[:-1])


def test_step_cost_plain_reference() -> None:
    cost = StepCost()
    assert cost.plain(1) is None
    for _ in range(8):
        cost.record(6, True, 1.6)  # only verifying steps: their fit's base holds the jump, no reference
    assert cost.plain(1) is None
    cost.record(1, False, 1.0)
    assert cost.plain(1) == pytest.approx(1.0)
    cost.record(4, False, 2.0)
    assert cost.plain(4) == pytest.approx(0.5)  # per sequence
    # with the draft's seconds per token, the gate weighs them: 1 expected token does not pay 1 s of draft
    assert cost.pays(1, 1.0, 1) is True or cost.fit() is None
    assert not cost.pays(1, 1.0, 1, draft_seconds=1.0)
