"""Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's last n tokens."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose(tokens: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """Up to k draft tokens continuing `tokens` (prompt + output); the longest suffix (n_max..n_min) that
    occurred before wins, and of its occurrences the latest with k tokens after it (text being echoed is read
    in order)."""
    if k < 1 or len(tokens) <= n_min:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        suffix = arr[-n:]
        # windows starting at 0..len-n-1: every occurrence except the suffix itself
        windows = sliding_window_view(arr[:-1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            # the latest occurrence followed by k tokens, else the earliest (the longest continuation): a run
            # of one repeated token must not shrink every draft to one token
            full = hits[hits + n + k <= len(tokens)]
            start = int(full[-1] if full.size else hits[0]) + n
            return tokens[start : start + k]
    return []
