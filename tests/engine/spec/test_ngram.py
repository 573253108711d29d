"""The n-gram lookup narrows the positions of the last token instead of comparing every window of every length:
it must propose exactly what the plain definition does (the longest suffix n_max..n_min seen before; of its
occurrences the latest with k tokens after it, else the earliest)."""

from __future__ import annotations

import random

from engine.spec import ngram


def reference(tokens: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    if k < 1 or len(tokens) <= n_min:
        return []
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        suffix = tokens[-n:]
        hits = [i for i in range(len(tokens) - n) if tokens[i : i + n] == suffix]
        if hits:
            full = [i for i in hits if i + n + k <= len(tokens)]
            start = (full[-1] if full else hits[0]) + n
            return tokens[start : start + k]
    return []


def test_same_drafts_as_the_definition() -> None:
    rng = random.Random(1)
    for _ in range(5000):
        vocab = rng.choice([2, 3, 5, 50])
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        k, lo = rng.randrange(0, 6), rng.randrange(1, 4)
        hi = rng.randrange(lo, 6)
        assert ngram.propose(tokens, k, hi, lo) == reference(tokens, k, hi, lo), (tokens, k, hi, lo)
