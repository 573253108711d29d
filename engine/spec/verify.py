"""Verification of draft tokens against the target model's distribution, one logits row per position.

A sequence with draft d_0..d_{k-1} has k + 1 rows: row j is the target's distribution after the sequence and
d_0..d_{j-1}. Row j is sampled with the sampler's own processors (penalties, bans and min_tokens see the
draft before j); d_j is accepted when the draw equals it, and the first draw that differs (or the draw of
row k, the bonus) ends the run. An n-gram draft is a point mass, so this is exact rejection sampling:
d_j is accepted with probability p(d_j), and on rejection the token comes from p with d_j removed and
renormalised. Greedy rows accept exactly the argmax run plain decoding would produce.
"""

from __future__ import annotations

import dataclasses

import torch

from engine.execution.sampler import Sampler
from engine.messages import TokenLogprobs
from engine.types.sequence import ScheduledSeq, Sequence


@dataclasses.dataclass(slots=True)
class Rows:
    """The sampled rows of a step: one Sequence view per logits row, and each sampling sequence's span."""

    seqs: list[Sequence]  # row i's sequence, with the draft tokens before it appended
    spans: list[tuple[Sequence, int, list[int]]]  # (sequence, first row, its draft) per sampling sequence


def sampled_rows(batch: list[ScheduledSeq]) -> Rows:
    """The logits rows the runner returns for `batch` (ModelRunner.prepare), in order."""
    rows = Rows([], [])
    for s in batch:
        if not s.samples:
            continue
        seq, draft = s.seq, s.seq.draft[: s.num_draft]
        rows.spans.append((seq, len(rows.seqs), draft))
        if not draft:
            rows.seqs.append(seq)
            continue
        if seq.params.seed is not None and seq.generator is None:  # the views must share the one stream
            seq.generator = torch.Generator().manual_seed(seq.params.seed)
        rows.seqs.append(seq)
        rows.seqs += [dataclasses.replace(seq, token_ids=seq.token_ids + draft[:j]) for j in range(1, len(draft) + 1)]
    return rows


def verify(
    sampler: Sampler, logits: torch.Tensor, rows: Rows
) -> list[tuple[Sequence, list[int], list[TokenLogprobs | None]]]:
    """Per sampling sequence: the tokens it emits this step (accepted draft tokens, then one drawn token) and
    their logprobs. A seeded sequence's rows are drawn one by one, stopping at the first rejection, so its
    generator advances exactly as without speculation."""
    n = len(rows.seqs)
    tokens: list[int] = [-1] * n
    lps: list[TokenLogprobs | None] = [None] * n
    seeded = [(first, draft) for seq, first, draft in rows.spans if draft and seq.params.seed is not None]
    skip = {first + j for first, draft in seeded for j in range(len(draft) + 1)}
    plain = [i for i in range(n) if i not in skip]
    if plain:
        part = logits if len(plain) == n else logits[torch.tensor(plain, device=logits.device)]
        out = sampler.sample(part, [rows.seqs[i] for i in plain], scratch=True)
        for i, t, lp in zip(plain, out.token_ids, out.logprobs):
            tokens[i], lps[i] = t, lp
    for first, draft in seeded:
        for j in range(len(draft) + 1):
            i = first + j
            one = sampler.sample(logits[i : i + 1], [rows.seqs[i]])
            tokens[i], lps[i] = one.token_ids[0], one.logprobs[0]
            if j == len(draft) or tokens[i] != draft[j]:
                break
    result = []
    for seq, first, draft in rows.spans:
        m = 0  # accepted draft tokens
        while m < len(draft) and tokens[first + m] == draft[m]:
            m += 1
        result.append((seq, tokens[first : first + m + 1], lps[first : first + m + 1]))
    return result
