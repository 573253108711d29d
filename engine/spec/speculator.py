"""The engine core's speculation: drafts for the running decodes before each step, the outcome of each
verification after it, and the counters behind vLLM's spec_decode_* metrics."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from engine.core.sequence import SeqStatus, Sequence
from engine.spec import ngram
from engine.spec.adaptive import StepCost, draft_length
from engine.spec.config import SpecConfig
from engine.structured.drafts import allowed_prefix, draft_room

if TYPE_CHECKING:
    from engine.spec.draft_model import DraftModel


def can_speculate(seq: Sequence) -> bool:
    """Text decoding, constrained or not (engine/structured/drafts.py): images and audio have their own
    positions and cross-attention."""
    return seq.mm is None and seq.audio is None


class Speculator:
    def __init__(self, config: SpecConfig, max_model_len: int, drafter: DraftModel | None = None) -> None:
        self.config = config
        self.drafter = drafter  # method draft_model: proposes for every speculating sequence in one batch
        self.draft_seconds = 0.0  # the draft model's CPU time for the coming step's proposals
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
        cost, jump = self.cost.relative(len(decoding)), self.cost.jump_share(len(decoding))
        gain, drafted = 0.0, 0
        wanted: list[tuple[Sequence, int]] = []  # a draft model's (sequence, k), proposed once the step pays
        for seq in decoding:
            if not can_speculate(seq):
                continue
            # never past max_tokens or the context: every draft token accepted plus the bonus must fit
            room = min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
            if seq.structured is not None:  # the forced finish must not act inside a verification
                room = min(room, draft_room(seq.structured, seq.params.max_tokens - seq.num_output_tokens))
            k = draft_length(seq.spec, cost, min(c.num_speculative_tokens, room), jump)
            if k:
                if self.drafter is None:
                    seq.draft = ngram.propose(seq.token_ids, k, c.prompt_lookup_max, c.prompt_lookup_min)
                else:
                    wanted.append((seq, k))
                n = k if self.drafter is not None else len(seq.draft)
                a = seq.spec.acceptance
                gain += sum(a**j for j in range(1, n + 1))  # expected accepted tokens
                drafted += n
        if drafted and not self.cost.pays(len(decoding), gain, drafted):
            for seq in decoding:  # the step's verification would cost the batch more than it gains
                if not seq.spec.probing:  # a probe is what finds out whether drafting pays again
                    seq.draft = []
            wanted = [(seq, k) for seq, k in wanted if seq.spec.probing]
        self.draft_seconds = 0.0
        if self.drafter is not None:
            self.drafter.retain(set(decoding))  # finished, aborted, preempted: their draft blocks go back
            if wanted:
                began = time.process_time()
                self.drafter.propose(wanted)
                self.draft_seconds = time.process_time() - began
        for seq in decoding:  # a token its grammar forbids ends a constrained sequence's draft
            if seq.structured is not None and seq.draft:
                seq.draft = allowed_prefix(seq.structured, seq.draft)

    def record(self, seq: Sequence, drafted: int, accepted: int) -> None:
        seq.spec.record(drafted, accepted)
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        for j in range(accepted):
            self.accepted_per_pos[j] += 1

    def record_step(self, tokens: int, drafted: bool, seconds: float) -> None:
        """A decode-only step's size, whether it verified a draft, and its time (engine/spec/adaptive.py)."""
        # a draft model's proposals are part of what drafting costs
        self.cost.record(tokens, drafted, seconds + (self.draft_seconds if drafted else 0.0))
