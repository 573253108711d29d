"""A request's state inside the engine core: its tokens, its progress and its KV blocks."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.messages import LoRARequest, SamplingParams
from engine.types.draft_state import DraftState

if TYPE_CHECKING:
    import torch

    from engine.types.constraint_state import StructuredState
    from engine.types.image_state import SeqAudio, SeqImages


class SeqStatus(enum.Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2
    WAITING_FOR_GRAMMAR = 3  # its constraint is compiling: not schedulable yet (vLLM's WAITING_FOR_FSM)


@dataclass(eq=False, slots=True)
class Sequence:
    request_id: str
    params: SamplingParams
    arrival_time: float
    token_ids: list[int]  # prompt + output; grows by one per decode step
    num_prompt_tokens: int
    priority: int = 0
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = -1  # prompt tokens found in the prefix cache, set at first schedule
    block_table: list[int] = field(default_factory=list)
    scheduled_time: float = 0.0
    first_token_time: float = 0.0
    num_preemptions: int = 0
    generator: torch.Generator | None = None  # per-request RNG when params.seed is set
    finish_reason: str | None = None
    stop_token_id: int | None = None
    error: str | None = None  # with finish_reason "error": why (a grammar that failed to compile or match)
    structured: StructuredState | None = None  # params.structured_outputs' matcher (engine/structured/)
    mm: SeqImages | None = None  # images (a vision model's request): M-RoPE positions, encoder outputs
    lora: LoRARequest | None = None  # its adapter (engine/lora/); None: the base model
    audio: SeqAudio | None = None  # a Whisper request's audio: features, then its cross-attention K/V
    draft: list[int] = field(default_factory=list)  # speculative tokens proposed for the next step (engine/spec/)
    spec: DraftState = field(default_factory=DraftState)  # its draft acceptance so far

    @classmethod
    def new(
        cls, request_id: str, prompt: list[int], params: SamplingParams, arrival_time: float, priority: int = 0
    ) -> Sequence:
        return cls(request_id, params, arrival_time, list(prompt), len(prompt), priority)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's share of a step: tokens [start, start + num_new_tokens) are run.

    `start` is seq.num_computed_tokens at scheduling time. When start + num_new_tokens ==
    seq.num_tokens the step samples a new token for it (the last prefill chunk, or a decode).
    A decode may carry the first `num_draft` tokens of seq.draft after its last token: the step
    then runs num_draft + 1 positions and samples each of them (engine/spec/verify.py).
    """

    seq: Sequence
    num_new_tokens: int
    num_draft: int = 0

    def input_ids(self) -> list[int]:
        """The token ids of the positions run: the sequence's, then the draft's."""
        start, n, k = self.seq.num_computed_tokens, self.num_new_tokens, self.num_draft
        ids = self.seq.token_ids[start : start + n - k]
        return ids + self.seq.draft[:k] if k else ids

    @property
    def start(self) -> int:
        return self.seq.num_computed_tokens

    @property
    def samples(self) -> bool:
        return self.seq.num_computed_tokens + self.num_new_tokens - self.num_draft == self.seq.num_tokens
