"""A sequence's draft acceptance and back-off (`Sequence.spec`); engine/spec/adaptive.py reads and updates it."""

from __future__ import annotations

from dataclasses import dataclass

DECAY = 0.8  # weight of the past in a sequence's acceptance counts per verification (about the last 5)
PRIOR_HITS, PRIOR_TRIALS = 1.0, 1.5  # 2 in 3, light: a new sequence tries drafting, 3-4 misses outweigh it
BACKOFF_MIN = 16  # decode steps without drafting once it stops paying, before one token is tried again


@dataclass(slots=True)
class DraftState:
    """One sequence's acceptance (decayed counts of draft tokens accepted and of accept/reject trials) and its
    back-off."""

    hits: float = PRIOR_HITS
    trials: float = PRIOR_TRIALS
    wait: int = 0  # decode steps left in the back-off
    backoff: int = BACKOFF_MIN  # the next back-off's length
    probing: bool = False  # this step's draft is the probe at a back-off's end (the step gate lets it through)

    @property
    def acceptance(self) -> float:
        """The chance the next draft token is accepted."""
        return self.hits / self.trials

    def record(self, drafted: int, accepted: int) -> None:
        trials = accepted + (1 if accepted < drafted else 0)  # the first rejection ends the run
        self.hits = self.hits * DECAY + accepted
        self.trials = self.trials * DECAY + trials
