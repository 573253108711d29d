"""The engine core's speculation: drafts for the running decodes before each step, the outcome of each
verification after it, and the counters behind vLLM's spec_decode_* metrics."""

from __future__ import annotations

from collections.abc import Iterable

from engine.core.sequence import SeqStatus, Sequence
from engine.spec import ngram
from engine.spec.adaptive import StepCost, draft_length
from engine.spec.config import SpecConfig


def can_speculate(seq: Sequence) -> bool:
    """Plain text decoding only: a grammar advances one token at a time, images and audio have their own
    positions and cross-attention."""
    return seq.structured is None and seq.mm is None and seq.audio is None


class Speculator:
    def __init__(self, config: SpecConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.cost = StepCost()
        self.num_drafts = 0  # verifications
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * config.num_speculative_tokens

    def propose(self, seqs: Iterable[Sequence]) -> None:
        """Set each running decode's draft for the next step (empty: a plain decode)."""
        decoding = []
        for seq in seqs:
            seq.draft = []
            if seq.status is SeqStatus.RUNNING and seq.num_tokens - seq.num_computed_tokens == 1:
                decoding.append(seq)
        c = self.config
        cost = self.cost.relative(len(decoding))
        gain, drafted = 0.0, 0
        for seq in decoding:
            if not can_speculate(seq):
                continue
            # never past max_tokens or the context: every draft token accepted plus the bonus must fit
            room = min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
            k = draft_length(seq.spec, cost, min(c.num_speculative_tokens, room))
            if k:
                seq.draft = ngram.propose(seq.token_ids, k, c.prompt_lookup_max, c.prompt_lookup_min)
                a = seq.spec.acceptance
                gain += sum(a**j for j in range(1, len(seq.draft) + 1))  # expected accepted tokens
                drafted += len(seq.draft)
        if drafted and not self.cost.pays(len(decoding), gain, drafted):
            for seq in decoding:  # the step's verification would cost the batch more than it gains
                seq.draft = []

    def record(self, seq: Sequence, drafted: int, accepted: int) -> None:
        seq.spec.record(drafted, accepted)
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        for j in range(accepted):
            self.accepted_per_pos[j] += 1

    def record_step(self, tokens: int, drafted: bool, seconds: float) -> None:
        """A decode-only step's size, whether it verified a draft, and its time (engine/spec/adaptive.py)."""
        self.cost.record(tokens, drafted, seconds)
