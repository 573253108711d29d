"""How many tokens each sequence drafts: as many as pay for themselves, from its measured acceptance and the
measured cost of one more token in a step (and, for a draft model, of the draft's own forwards per drafted
token); zero when speculation does not pay, then a back-off of BACKOFF_MIN decode steps, doubling after each
failed probe up to BACKOFF_MAX, during which the sequence costs nothing (no lookup, no fit: `draft_length`
counts down), and one draft token as the probe at its end, unless no acceptance could pay for the probe."""

from __future__ import annotations

from collections import deque

import numpy as np

from engine.types.draft_state import BACKOFF_MIN, DraftState

BACKOFF_MAX = 512  # the longest back-off (a probe that fails doubles it)
DEFAULT_COST = 0.1  # one more token's share of a decode step, until steps have been timed
COST_SAMPLES = 64  # decode steps kept for the cost fit
FIT_EVERY = 8  # steps recorded between two fits (a least-squares fit every step costs more than it changes)
DRAFT_DECAY = 0.7  # weight of the past in a draft model's cost per drafted token
PROBE_SHARE = 0.02  # a draft model's probe catches up over its back-off: only if that costs at most this share


def hopeless(cost: float, most: int, jump: float) -> bool:
    """Whether drafting could not pay even were every draft token accepted: each costs a whole token or more,
    or `most` of them gain less than the verification's fixed cost."""
    return cost >= 1.0 or (1.0 - cost) * most < jump


def draft_length(state: DraftState, cost: float, most: int, jump: float = 0.0, probe: bool = True) -> int:
    """The largest k <= most whose k-th draft token is used at least as often as it costs (acceptance^k >=
    cost, the cost of a token in the step plus a draft model's per token), if the k tokens' expected gain also
    pays the verification's fixed cost (`jump`, as a share of a token's time). When it does not: 0 for the next
    `backoff` calls, one token (the probe) at the last of them, and the back-off after that twice as long;
    drafting that pays two tokens again resets it. The probe is skipped (the back-off starts again, doubled)
    when no acceptance could pay (it would measure nothing the decision depends on), or `probe` is false (a
    draft model whose catch-up over the back-off would cost more than PROBE_SHARE of it)."""
    state.probing = False
    if most < 1:
        return 0
    if state.wait:
        state.wait -= 1
        state.probing = not state.wait and probe and not hopeless(cost, most, jump)
        if not state.wait and not state.probing:
            state.wait = state.backoff
            state.backoff = min(state.backoff * 2, BACKOFF_MAX)
        return int(state.probing)
    a, k, p, gain = state.acceptance, 0, 1.0, 0.0
    while k < most and p * a >= cost:
        p *= a
        k += 1
        gain += p
    if k and gain - cost * k < jump:
        k = 0
    if k == 0:
        state.wait = state.backoff
        state.backoff = min(state.backoff * 2, BACKOFF_MAX)
    elif k >= 2:  # more than a lucky probe: speculation pays again
        state.backoff = BACKOFF_MIN
    return k


class StepCost:
    """What drafting costs, fitted online over recent decode steps (no prefill in them): step seconds = base +
    per_token * tokens + jump * (the step verifies a draft). The jump is what a verification's chunk costs the
    whole batch (on CPU a pure decode step runs fused kernels a chunk turns off); the last one fitted is kept
    while the window holds too few verifying steps to fit it again (a backed-off sequence drafts rarely)."""

    def __init__(self) -> None:
        self._samples: deque[tuple[int, bool, float]] = deque(maxlen=COST_SAMPLES)
        self._fit: tuple[float, float, float] | None = None
        self._jump = 0.0
        self._stale = 0  # samples recorded since the last fit
        self._both = False  # the last fit had plain and verifying steps (its base is a plain step's)

    def record(self, tokens: int, drafted: bool, seconds: float) -> None:
        self._samples.append((tokens, drafted, seconds))
        self._stale += 1

    def fit(self) -> tuple[float, float, float] | None:
        """(base, per_token, jump) in seconds, or None before there is enough to fit; refitted every FIT_EVERY
        samples."""
        if self._stale >= FIT_EVERY or (self._fit is None and self._stale):
            self._stale = 0
            self._fit = self._refit()
        return self._fit

    def _refit(self) -> tuple[float, float, float] | None:
        s = self._samples
        drafted = sum(1 for _, d, _ in s if d)
        if len(s) < 8 or len({t for t, _, _ in s}) < 2:
            return None
        both = self._both = 2 <= len(s) - drafted and 4 <= drafted  # the jump needs steps of both kinds
        x = np.array([[1.0, t, float(d)] if both else [1.0, t, 0.0] for t, d, _ in s])
        y = np.array([sec for _, _, sec in s])
        coef = np.linalg.lstsq(x if both else x[:, :2], y, rcond=None)[0]
        base, slope = max(float(coef[0]), 1e-6), max(float(coef[1]), 0.0)
        if both:
            self._jump = max(float(coef[2]), 0.0)
        return base, slope, self._jump

    @property
    def plain_steps(self) -> int:
        """Plain (not verifying) steps in the window: the fit tells the jump from the base with 2 or more."""
        return sum(1 for _, d, _ in self._samples if not d)

    def plain(self, num_seqs: int) -> float | None:
        """A plain decode step's seconds per sequence at this batch size: the window's plain steps of that size,
        else the fit when it measured the verification's jump apart (a fit of verifying steps alone has the jump
        in its base); None: no reference yet (a plain step gives one)."""
        same = [sec for t, d, sec in self._samples if not d and t == num_seqs]
        if same:
            return sum(same) / len(same) / num_seqs
        fit = self.fit()
        if fit is None or not self._both or num_seqs < 1:
            return None
        base, slope, _ = fit
        return (base + slope * num_seqs) / num_seqs

    def relative(self, num_seqs: int) -> float:
        """per_token * seqs / (base + per_token * seqs): what one draft token costs one sequence."""
        fit = self.fit()
        if fit is None or num_seqs < 1:
            return DEFAULT_COST
        base, slope, _ = fit
        return min(max(slope * num_seqs / (base + slope * num_seqs), 0.01), 1.0)

    def jump_share(self, num_seqs: int) -> float:
        """jump / (base + per_token * seqs): a verification's fixed cost against a token's worth of one
        sequence's time, were every decoding sequence to share it."""
        fit = self.fit()
        if fit is None or num_seqs < 1:
            return 0.0
        base, slope, jump = fit
        return jump / (base + slope * num_seqs)

    def pays(self, num_seqs: int, gain: float, draft_tokens: int, draft_seconds: float = 0.0) -> bool:
        """Whether a step verifying draft_tokens, expected to accept `gain` of them, beats a plain decode step:
        the tokens gained are worth a plain step's time per sequence each; a draft model's forwards cost
        draft_seconds per drafted token."""
        fit = self.fit()
        if fit is None or num_seqs < 1:
            return True
        base, slope, jump = fit
        return gain * (base + slope * num_seqs) / num_seqs >= jump + (slope + draft_seconds) * draft_tokens


class DraftCost:
    """A draft model's CPU seconds per drafted token, a decayed average over its proposals: each forward that
    only continues sequences (single tokens, or a catch-up no longer than a verification: the accepted tokens
    and the bonus) is a steady-state one; a call's cost is their mean times its forwards, over the tokens it
    drafted. A new sequence's prompt or a back-off's gap is a one-off prefill, not a per-token cost. Kept while
    nothing drafts: measuring it again would cost a catch-up over every token since (a draft as big as the
    target prefilling the whole context), and an estimate too high only forgoes a speed-up."""

    def __init__(self, most: int) -> None:
        self.most = most  # num_speculative_tokens: a longer catch-up is not a steady-state one
        self.seconds: float | None = None
        self.catch_up: float | None = None  # seconds per token of a long catch-up (a prefill on the draft)

    def record(self, forwards: list[tuple[float, int, int]], drafted: int) -> None:
        """forwards: (seconds, longest chunk, tokens) of each forward of a proposal that drafted `drafted`."""
        for sec, chunk, tokens in forwards:
            if chunk > self.most + 1:
                sample = sec / tokens
                self.catch_up = sample if self.catch_up is None else (self.catch_up + sample) / 2
        steady = [sec for sec, chunk, _ in forwards if chunk <= self.most + 1]
        if not steady or drafted < 1:
            return
        sample = sum(steady) / len(steady) * len(forwards) / drafted
        old = self.seconds
        self.seconds = sample if old is None else DRAFT_DECAY * old + (1 - DRAFT_DECAY) * sample

    def probes_pay(self, plain: float) -> bool:
        """Whether a probe's catch-up (a token of prefill on the draft per decode step backed off) costs at
        most PROBE_SHARE of the back-off (`plain`: a plain step's seconds per sequence)."""
        return self.catch_up is None or self.catch_up <= PROBE_SHARE * plain
