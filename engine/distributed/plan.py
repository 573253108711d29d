"""A step's plan: what rank 0 broadcasts so every rank can run the same forward without a scheduler.

Per scheduled sequence only what `ModelRunner.prepare` reads: the new token ids, the first position, the
block table, whether it samples and whether it wants prompt logits, and how many of the ids are a
speculative draft (a verification: its k + 1 rows reach the LM head on every rank). Other ranks rebuild
stand-in sequences (`_PlannedSeq`) from it, so the runner's metadata code runs unchanged on every rank.
Only rank 0 samples, so only it knows how many draft tokens a verification accepted; the other ranks never
need to: the next plan carries the first position past the accepted ones and the block table after the trim,
and a rejected position's K/V is rewritten before any query can read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import msgspec

from engine.messages import LoRARequest
from engine.types.sequence import ScheduledSeq, Sequence

GENERATE, POOL, TICK, STOP = 0, 1, 2, 3  # plan kinds: a generate step, a pooling step, rank 0 alive, shut down


class PlannedSeq(msgspec.Struct, array_like=True):
    new_token_ids: list[int]
    start: int
    block_table: list[int]
    samples: bool
    prompt_logits: bool  # the LM head runs for its rows (collective: every rank must take part)
    lora: LoRARequest | None = None  # its adapter: every rank loads it (engine/lora/manager.py)
    num_draft: int = 0  # the last num_draft ids are draft tokens under verification (engine/spec/verify.py)


class StepPlan(msgspec.Struct, array_like=True):
    kind: int
    seqs: list[PlannedSeq] = []
    all_rows: bool = False  # POOL: every row's hidden state (MEAN pooling)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(StepPlan)


def encode(plan: StepPlan) -> bytes:
    return _encoder.encode(plan)


def decode(data: bytes) -> StepPlan:
    return _decoder.decode(data)


def plan_of(kind: int, batch: list[ScheduledSeq], all_rows: bool = False) -> StepPlan:
    seqs = []
    for s in batch:
        seq, start = s.seq, s.start
        wants_prompt = seq.params.prompt_logprobs is not None and start < seq.num_prompt_tokens
        seqs.append(PlannedSeq(s.input_ids(), start, seq.block_table, s.samples, wants_prompt, seq.lora, s.num_draft))
    return StepPlan(kind, seqs, all_rows)


class _Window:
    """token_ids[start:start + n] of a sequence whose other tokens this rank never sees."""

    def __init__(self, start: int, ids: list[int]) -> None:
        self.start, self.ids = start, ids

    def __getitem__(self, s: slice) -> list[int]:
        return self.ids[s.start - self.start : s.stop - self.start]


@dataclass
class _Params:
    prompt_logprobs: int | None


@dataclass
class _PlannedSeqState:
    """The fields of a Sequence that ModelRunner.prepare and ScheduledSeq read."""

    token_ids: _Window
    block_table: list[int]
    params: _Params
    num_computed_tokens: int
    num_tokens: int
    num_prompt_tokens: int
    lora: LoRARequest | None
    draft: list[int]


def batch_of(plan: StepPlan) -> list[ScheduledSeq]:
    batch = []
    for p in plan.seqs:
        n, k = len(p.new_token_ids), p.num_draft
        end = p.start + n - k  # past the sequence's own tokens; the draft's follow
        seq = _PlannedSeqState(
            _Window(p.start, p.new_token_ids),
            p.block_table,
            _Params(1 if p.prompt_logits else None),
            p.start,
            end if p.samples else end + 1,  # ScheduledSeq.samples: start + n - num_draft == num_tokens
            end + 1 if p.prompt_logits else 0,
            p.lora,
            p.new_token_ids[n - k :] if k else [],
        )
        batch.append(ScheduledSeq(cast(Sequence, seq), n, k))
    return batch
