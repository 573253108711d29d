"""The engine core's speculation: drafts for the running decodes before each step, the outcome of each
verification after it, and the counters behind vLLM's spec_decode_* metrics."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from engine.config import EngineEnv
from engine.spec import ngram
from engine.spec.adaptive import DraftCost, StepCost, draft_length
from engine.spec_config import SpecConfig
from engine.structured.drafts import allowed_prefix, draft_room
from engine.types.sequence import SeqStatus, Sequence

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
        self.max_model_len = max_model_len
        self.cost = StepCost()
        self.draft_cost = DraftCost(config.num_speculative_tokens)  # a draft model's forwards per drafted token
        # 0: a draft model's own cost is not weighed (acceptance checks, tests of the draft path on tiny models)
        self.weigh_draft = EngineEnv.read().spec_draft_cost
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
        c, n = self.config, len(decoding)
        cost, jump = self.cost.relative(n), self.cost.jump_share(n)
        per_token = 0.0  # a draft model's seconds per drafted token
        drafting, probe = decoding, True
        if self.drafter is not None and self.weigh_draft and (per_token := self.draft_cost.seconds or 0.0):
            plain = self.cost.plain(n)
            if plain is None or self.cost.plain_steps < 2:  # this step measures a plain one (and the jump)
                drafting = []
            else:
                cost += per_token / plain  # as a share of a sequence's plain step, like the step's own cost
                probe = self.draft_cost.probes_pay(plain)
        gain, drafted = 0.0, 0
        wanted: list[tuple[Sequence, int]] = []  # a draft model's (sequence, k), proposed once the step pays
        for seq in drafting:
            if not can_speculate(seq):
                continue
            # never past max_tokens or the context: every draft token accepted plus the bonus must fit
            room = min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
            if seq.structured is not None:  # the forced finish must not act inside a verification
                room = min(room, draft_room(seq.structured, seq.params.max_tokens - seq.num_output_tokens))
            k = draft_length(seq.spec, cost, min(c.num_speculative_tokens, room), jump, probe)
            if k:
                if self.drafter is None:
                    seq.draft = ngram.propose(seq.token_ids, k, c.prompt_lookup_max, c.prompt_lookup_min)
                else:
                    wanted.append((seq, k))
                m = k if self.drafter is not None else len(seq.draft)
                a = seq.spec.acceptance
                gain += sum(a**j for j in range(1, m + 1))  # expected accepted tokens
                drafted += m
        if drafted and not self.cost.pays(n, gain, drafted, per_token):
            for seq in decoding:  # the step's verification would cost the batch more than it gains
                if not seq.spec.probing:  # a probe is what finds out whether drafting pays again
                    seq.draft = []
            wanted = [(seq, k) for seq, k in wanted if seq.spec.probing]
        if self.drafter is not None:
            self.drafter.retain(set(decoding))  # finished, aborted, preempted: their draft blocks go back
            if wanted:
                self.draft_cost.record(self.drafter.propose(wanted), sum(k for _, k in wanted))
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
        """A decode-only step's size, whether it verified a draft, and its time (engine/spec/adaptive.py); a
        draft model's forwards are timed apart (DraftCost)."""
        self.cost.record(tokens, drafted, seconds)
