"""Scores of text pairs (vLLM's /score and /rerank): a cross-encoder's one logit through its activation, or the
cosine similarity of two embeddings; which pairs one request makes; rerank order."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import numpy as np

from server.families.pooling.finishing import activate
from server.http.errors import bad_request

T = TypeVar("T")


def pair_up(queries: Sequence[T], documents: Sequence[T], names: tuple[str, str]) -> list[tuple[T, T]]:
    """1:1, 1:N (one query against every document) or N:N (zipped); other lengths are a 400."""
    if not queries:
        raise bad_request(f"{names[0]} must not be empty.", names[0])
    if not documents:
        raise bad_request(f"{names[1]} must not be empty.", names[1])
    if len(queries) == 1:
        return [(queries[0], d) for d in documents]
    if len(queries) != len(documents):
        raise bad_request(
            f"{names[0]} and {names[1]} must be 1:1, 1:N or N:N; got {len(queries)} and {len(documents)}.", names[1]
        )
    return list(zip(queries, documents))


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Cosine similarity as sentence-transformers' cos_sim (each vector normalized with eps 1e-12 first)."""
    na = a / max(float(np.linalg.norm(a)), 1e-12)
    nb = b / max(float(np.linalg.norm(b)), 1e-12)
    return float(np.dot(na.astype(np.float64), nb.astype(np.float64)))


def cross_score(logits: np.ndarray, activation: str, use_activation: bool) -> float:
    """A one-label classifier's score of a pair: its single logit, through the activation when on."""
    v = activate(logits, activation) if use_activation else logits
    return float(v.reshape(-1)[0])


def rerank_order(scores: Sequence[float], top_n: int | None) -> list[int]:
    """Indexes by descending score (ties: the earlier document first), the first `top_n` (None or 0: all)."""
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    return order[:top_n] if top_n else order
