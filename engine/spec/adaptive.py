"""How many tokens each sequence drafts: as many as pay for themselves, from its measured acceptance and the
measured cost of one more token in a step; zero when speculation does not pay, with a rare probe to notice
when it starts to."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

DECAY = 0.9  # weight of the past in a sequence's acceptance counts per verification (about the last 10)
PROBE_EVERY = 32  # decode steps without drafting before one draft token is tried again
DEFAULT_COST = 0.1  # one more token's share of a decode step, until steps have been timed
COST_SAMPLES = 64  # decode steps kept for the cost fit


@dataclass(slots=True)
class DraftState:
    """One sequence's acceptance: decayed counts of draft tokens accepted and of accept/reject trials."""

    hits: float = 2.0  # a prior of 2 in 3, decaying like the rest: a new sequence tries drafting
    trials: float = 3.0
    idle: int = 0  # decode steps since it last drafted

    @property
    def acceptance(self) -> float:
        """The chance the next draft token is accepted."""
        return self.hits / self.trials

    def record(self, drafted: int, accepted: int) -> None:
        trials = accepted + (1 if accepted < drafted else 0)  # the first rejection ends the run
        self.hits = self.hits * DECAY + accepted
        self.trials = self.trials * DECAY + trials


def draft_length(state: DraftState, cost: float, most: int) -> int:
    """The largest k <= most whose k-th draft token is used at least as often as it costs (acceptance^k >=
    cost); 0 when even the first does not pay, except one token every PROBE_EVERY steps."""
    a, k, p = state.acceptance, 0, 1.0
    while k < most and p * a >= cost:
        p *= a
        k += 1
    if k == 0:
        state.idle += 1
        if state.idle >= PROBE_EVERY and most > 0:
            k = 1
    if k:
        state.idle = 0
    return k


class StepCost:
    """What drafting costs, fitted online over recent decode steps (no prefill in them): step seconds = base +
    per_token * tokens + jump * (the step verifies a draft). The jump is what a verification's chunk costs the
    whole batch (on CPU a pure decode step runs fused kernels a chunk turns off)."""

    def __init__(self) -> None:
        self._samples: deque[tuple[int, bool, float]] = deque(maxlen=COST_SAMPLES)

    def record(self, tokens: int, drafted: bool, seconds: float) -> None:
        self._samples.append((tokens, drafted, seconds))

    def fit(self) -> tuple[float, float, float] | None:
        """(base, per_token, jump) in seconds, or None before there is enough to fit."""
        s = self._samples
        drafted = sum(1 for _, d, _ in s if d)
        if len(s) < 8 or len({t for t, _, _ in s}) < 2:
            return None
        both = 4 <= drafted <= len(s) - 4  # the jump needs steps of both kinds
        x = np.array([[1.0, t, float(d)] if both else [1.0, t, 0.0] for t, d, _ in s])
        y = np.array([sec for _, _, sec in s])
        coef = np.linalg.lstsq(x if both else x[:, :2], y, rcond=None)[0]
        base, slope = max(float(coef[0]), 1e-6), max(float(coef[1]), 0.0)
        return base, slope, max(float(coef[2]), 0.0) if both else 0.0

    def relative(self, num_seqs: int) -> float:
        """per_token * seqs / (base + per_token * seqs): what one draft token costs one sequence."""
        fit = self.fit()
        if fit is None or num_seqs < 1:
            return DEFAULT_COST
        base, slope, _ = fit
        return min(max(slope * num_seqs / (base + slope * num_seqs), 0.01), 1.0)

    def pays(self, num_seqs: int, gain: float, draft_tokens: int) -> bool:
        """Whether a step verifying draft_tokens, expected to accept `gain` of them, beats a plain decode step:
        the tokens gained are worth a plain step's time per sequence each."""
        fit = self.fit()
        if fit is None or num_seqs < 1:
            return True
        base, slope, jump = fit
        return gain * (base + slope * num_seqs) / num_seqs >= jump + slope * draft_tokens
