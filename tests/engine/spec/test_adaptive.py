"""The adaptive draft length on a simulated clock: a sequence whose drafts are never accepted stops drafting after a
few verifications and probes rarely (its speed stays within a few percent of plain decoding), one whose drafts are
accepted keeps drafting, a backed-off sequence costs no lookup; the step cost fit. No timing: the step costs are
made up and fed to the fit."""

from __future__ import annotations

import random

import pytest

from engine.messages import SamplingParams
from engine.spec import speculator
from engine.spec.adaptive import BACKOFF_MAX, DEFAULT_COST, StepCost, draft_length
from engine.spec.speculator import Speculator
from engine.spec_config import SpecConfig
from engine.types.draft_state import BACKOFF_MIN, DraftState
from engine.types.sequence import SeqStatus, Sequence

PLAIN, JUMP, PER_TOKEN = 1.0, 0.3, 0.05  # made-up step seconds: a verification's chunk costs the step 30% more


class Sim:
    """One decoding sequence under the real Speculator; each draft token is accepted with probability `p`
    (drawn in order, the first miss ends the run); the clock advances by the made-up step costs."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, p: float, k: int = 5) -> None:
        self.spec = Speculator(SpecConfig("ngram", k, 3, 1), max_model_len=100_000)
        self.seq = Sequence.new("s", [1, 2, 3], SamplingParams(max_tokens=50_000), 0.0)
        self.seq.status = SeqStatus.RUNNING
        self.rng, self.p = random.Random(0), p
        self.lookups = 0
        self.clock = 0.0
        self.verifications = 0

        def lookup(tokens: list[int], k: int, n_max: int, n_min: int) -> list[int]:
            self.lookups += 1
            return [7] * k

        monkeypatch.setattr(speculator.ngram, "propose", lookup)

    def step(self) -> None:
        seq = self.seq
        seq.num_computed_tokens = seq.num_tokens - 1  # a decode: one token not yet run
        self.spec.propose([seq])
        k = len(seq.draft)
        accepted = 0
        while accepted < k and self.rng.random() < self.p:
            accepted += 1
        seconds = PLAIN + (JUMP + PER_TOKEN * k if k else 0.0)
        self.clock += seconds
        if k:
            self.verifications += 1
            self.spec.record(seq, k, accepted)
        self.spec.record_step(1 + k, k > 0, seconds)
        seq.token_ids += [7] * (accepted + 1)

    def speed(self, tokens: int) -> float:
        """Tokens per made-up second against plain decoding's 1 / PLAIN."""
        start, began = self.seq.num_tokens, self.clock
        while self.seq.num_tokens - start < tokens:
            self.step()
        return (self.seq.num_tokens - start) / (self.clock - began) * PLAIN


def test_text_that_never_repeats_stays_at_plain_speed(monkeypatch: pytest.MonkeyPatch) -> None:
    sim = Sim(monkeypatch, p=0.0)
    assert sim.speed(128) >= 0.95  # the bar, on a 128-token answer with its start-up trials
    assert sim.verifications <= 9  # 5 while the prior fades, then probes after 16, 33 and 66 steps
    first = sim.verifications
    assert sim.speed(2000) >= 0.99  # afterwards only rare probes
    assert sim.verifications - first <= 8  # back-offs of 16, 32, ... 512 steps
    assert sim.lookups == sim.verifications  # no lookup in a back-off step


def test_text_that_repeats_keeps_drafting(monkeypatch: pytest.MonkeyPatch) -> None:
    sim = Sim(monkeypatch, p=0.95)
    assert sim.speed(500) >= 2.5
    assert sim.seq.spec.wait == 0


def test_low_acceptance_backs_off(monkeypatch: pytest.MonkeyPatch) -> None:
    sim = Sim(monkeypatch, p=0.05)
    assert sim.speed(2000) >= 0.97
    assert sim.verifications <= 60


def test_falls_to_zero_after_a_few_misses_and_probes_rarely() -> None:
    state = DraftState()
    assert draft_length(state, DEFAULT_COST, 5) > 0  # a new sequence tries
    misses = 0
    while draft_length(state, DEFAULT_COST, 5):
        state.record(5, 0)
        misses += 1
    assert misses <= 5
    # the back-off: BACKOFF_MIN - 1 zeros, then a one-token probe; each failed probe doubles the wait
    gaps = []
    for _ in range(6):
        lengths = []
        while not lengths or lengths[-1] == 0:
            lengths.append(draft_length(state, DEFAULT_COST, 5))
        assert lengths[-1] == 1
        gaps.append(len(lengths))
        state.record(1, 0)
    assert gaps == [BACKOFF_MIN, 2 * BACKOFF_MIN + 1, 4 * BACKOFF_MIN + 1, 8 * BACKOFF_MIN + 1, 257, BACKOFF_MAX + 1]


def test_a_probe_that_lands_resumes_drafting() -> None:
    state = DraftState(hits=0.0, trials=5.0, wait=1, backoff=4 * BACKOFF_MIN)
    assert draft_length(state, DEFAULT_COST, 5) == 1  # the probe
    state.record(1, 1)
    for _ in range(3):
        k = draft_length(state, DEFAULT_COST, 5)
        assert k > 0
        state.record(k, k)
    assert draft_length(state, DEFAULT_COST, 5) == 5 and state.backoff == BACKOFF_MIN


def test_never_above_the_room_left() -> None:
    assert draft_length(DraftState(), DEFAULT_COST, 2) == 2
    state = DraftState(wait=1)
    assert draft_length(state, DEFAULT_COST, 0) == 0 and state.wait == 1  # no room: the back-off does not move
    good = DraftState()
    for _ in range(20):
        good.record(4, 4)
    assert draft_length(good, DEFAULT_COST, 4) == 4
    assert draft_length(good, 1.0, 4) == 0  # a token costing a whole step never pays


def test_step_cost_fit() -> None:
    cost = StepCost()
    assert cost.relative(1) == DEFAULT_COST and cost.pays(1, 0.0, 5)  # nothing measured: try
    for tokens in [1, 2, 3, 4, 5, 6, 7, 8] * 2:
        cost.record(tokens, False, 0.010 + 0.001 * tokens)  # base 10 ms, 1 ms a token
    assert cost.relative(1) == pytest.approx(0.001 / 0.011)
    assert cost.relative(8) == pytest.approx(0.008 / 0.018)
    for tokens in [2, 6, 7, 12] * 2:
        cost.record(tokens, True, 0.015 + 0.001 * tokens)  # a verification costs the step 5 ms more
    fit = cost.fit()
    assert fit is not None and fit == pytest.approx((0.010, 0.001, 0.005))
    # one sequence: a plain step is 11 ms; 4 draft tokens cost 9 ms, so 0.8 expected tokens do not pay, 0.9 do
    assert not cost.pays(1, 0.8, 4) and cost.pays(1, 0.9, 4)
    for _ in range(64):  # a window with no verification: the jump fitted last is kept
        cost.record(1 + _ % 2, False, 0.010 + 0.001 * (1 + _ % 2))
    fit = cost.fit()
    assert fit is not None and fit[2] == pytest.approx(0.005)
