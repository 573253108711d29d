"""Verification samples the target distribution exactly: a chi-square test on a six-token vocabulary."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from engine.execution.sampler import Sampler
from engine.messages import SamplingParams
from engine.spec.verify import sampled_rows, verify
from engine.types.sequence import ScheduledSeq, Sequence

V = 6
DRAWS = 6000
CHI2_CRIT = 20.5  # chi-square, 5 degrees of freedom, p = 0.001


def chi2(counts: Counter[int], probs: torch.Tensor, n: int) -> float:
    return sum((counts.get(t, 0) - n * float(p)) ** 2 / (n * float(p)) for t, p in enumerate(probs) if p > 0)


def target(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The processed distribution: temperature, then top_k."""
    x = logits / params.temperature
    if params.top_k:
        x = x.masked_fill(x < x.topk(params.top_k).values[-1], -math.inf)
    return torch.softmax(x, -1)


@pytest.mark.parametrize(
    "params,draft",
    [
        (SamplingParams(max_tokens=8, temperature=1.0), 2),
        (SamplingParams(max_tokens=8, temperature=0.6), 0),
        (SamplingParams(max_tokens=8, temperature=1.3, top_k=4), 5),  # the draft lies outside top_k
    ],
)
def test_first_token_follows_target(params: SamplingParams, draft: int) -> None:
    torch.manual_seed(0)
    logits = torch.tensor([[1.0, 0.2, 1.5, -0.5, 0.7, 0.0], [0.3, 1.1, -0.2, 0.9, 0.0, 0.4]])
    sampler = Sampler(V, [], torch.device("cpu"))
    first: Counter[int] = Counter()
    second: Counter[int] = Counter()
    for _ in range(DRAWS):
        seq = Sequence.new("r", [1, 3], params, 0.0)
        seq.num_computed_tokens = 1
        seq.draft = [draft]
        rows = sampled_rows([ScheduledSeq(seq, 2, 1)])
        [(_, emitted, _)] = verify(sampler, logits.clone(), rows)
        first[emitted[0]] += 1
        if len(emitted) == 2:  # accepted: the bonus follows the second row
            assert emitted[0] == draft
            second[emitted[1]] += 1
    p0 = target(logits[0], params)
    assert chi2(first, p0, DRAWS) < CHI2_CRIT, (first, p0)
    if p0[draft] == 0:
        assert not second
    else:
        assert chi2(second, target(logits[1], params), sum(second.values())) < CHI2_CRIT


def test_wrong_target_is_detected() -> None:
    """The test's power: counts from a uniform distribution fail it."""
    counts = Counter({t: DRAWS // V for t in range(V)})
    logits = torch.tensor([1.0, 0.2, 1.5, -0.5, 0.7, 0.0])
    assert chi2(counts, torch.softmax(logits, -1), DRAWS) > CHI2_CRIT


def test_greedy_accepts_the_argmax_run() -> None:
    params = SamplingParams(max_tokens=8, temperature=0.0)
    logits = torch.tensor([[0.0, 3.0, 0.0], [0.0, 0.0, 2.0], [5.0, 0.0, 0.0]])
    seq = Sequence.new("g", [0], params, 0.0)
    seq.draft = [1, 0]  # the first is the argmax, the second is not
    [(_, emitted, _)] = verify(Sampler(3, [], torch.device("cpu")), logits, sampled_rows([ScheduledSeq(seq, 3, 2)]))
    assert emitted == [1, 2]
