"""How many tokens each sequence drafts: as many as pay for themselves, from its measured acceptance and the
measured cost of one more token in a step; zero when speculation does not pay, with a rare probe to notice
when it starts to."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

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
    """One more token's cost relative to a sequence's share of a decode step, fitted online: step seconds =
    base + per_token * tokens over recent decode steps (no prefill in them)."""

    def __init__(self) -> None:
        self._samples: deque[tuple[int, float]] = deque(maxlen=COST_SAMPLES)

    def record(self, tokens: int, seconds: float) -> None:
        self._samples.append((tokens, seconds))

    def relative(self, num_seqs: int) -> float:
        """per_token * seqs / (base + per_token * seqs): what one draft token costs one sequence."""
        s = self._samples
        if len(s) < 8 or num_seqs < 1:
            return DEFAULT_COST
        n = len(s)
        mx = sum(t for t, _ in s) / n
        my = sum(y for _, y in s) / n
        var = sum((t - mx) ** 2 for t, _ in s)
        if var < 1.0:  # every step the same size: no slope to read
            return DEFAULT_COST
        slope = max(sum((t - mx) * (y - my) for t, y in s) / var, 0.0)
        base = max(my - slope * mx, 1e-6)
        return min(max(slope * num_seqs / (base + slope * num_seqs), 0.01), 1.0)
