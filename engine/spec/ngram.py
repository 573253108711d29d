"""Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's last n tokens."""

from __future__ import annotations

import numpy as np


def propose(tokens: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """Up to k draft tokens continuing `tokens` (prompt + output); the longest suffix (n_max..n_min) that
    occurred before wins, and of its occurrences the latest with k tokens after it (text being echoed is read
    in order)."""
    size = len(tokens)
    if k < 1 or size <= n_min:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    # one pass over the sequence: the earlier positions of its last token; each longer suffix narrows them
    # (a miss, the common case in free text, costs that pass alone)
    ends = np.flatnonzero(arr[:-1] == arr[-1])
    found = ends[:0]
    for m in range(1, min(n_max, size - 1) + 1):
        if m > 1:
            ends = ends[ends >= m - 1]
            ends = ends[arr[ends - (m - 1)] == arr[size - m]]
        if not ends.size:
            break
        if m >= n_min:
            found = ends
    if not found.size:
        return []
    # the latest occurrence followed by k tokens, else the earliest (the longest continuation): a run of one
    # repeated token must not shrink every draft to one token
    full = found[found + 1 + k <= size]
    start = int(full[-1] if full.size else found[0]) + 1
    return tokens[start : start + k]
