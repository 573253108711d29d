"""Cohere's embedding types from float embeddings, as sentence-transformers' `quantize_embeddings` computes them.

int8 / uint8: per-dimension ranges [start, end], step = (end - start) / 255, value = clip(floor((x - start) /
step), 0, 255), minus 128 for int8. `quantize_embeddings` without ranges takes each dimension's min and max over
the embeddings it is given (and refuses a single embedding): the values of one text would then depend on what
else is in the request. The ranges here are fixed instead: [-1, 1] in every dimension, the range of a unit
vector's components, so a text's int8 embedding is the same in any request; components outside it (a model
that does not normalize) saturate at the ends. ubinary: the bits x > 0 of each embedding packed most significant
bit first (the last byte padded with zeros); binary: ubinary - 128 as int8. base64: the float32 values,
little-endian, as OpenAI's base64 embeddings.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

EMBEDDING_TYPES = ("float", "int8", "uint8", "binary", "ubinary", "base64")
RANGE = (-1.0, 1.0)  # every dimension's [start, end] for int8 / uint8


def ranges(dims: int) -> np.ndarray:
    """[2, dims] float32: the fixed per-dimension ranges (quantize_embeddings' `ranges` argument)."""
    return np.array([[RANGE[0]] * dims, [RANGE[1]] * dims], dtype=np.float32)


def _buckets(e: np.ndarray) -> np.ndarray:
    r = ranges(e.shape[-1])
    starts = r[0, :]
    steps = (r[1, :] - starts) / 255
    out: np.ndarray = np.clip(np.floor((e.astype(np.float32) - starts) / steps), 0, 255)
    return out


def quantize(e: np.ndarray, kind: str) -> list[Any]:
    """[n, d] float32 embeddings -> one JSON list (or base64 text) per embedding."""
    if kind == "float":
        out: list[Any] = e.astype(np.float32).tolist()
    elif kind == "uint8":
        out = _buckets(e).astype(np.uint8).tolist()
    elif kind == "int8":
        out = (_buckets(e) - 128).astype(np.int8).tolist()
    elif kind == "ubinary":
        out = np.packbits(e > 0, axis=-1).tolist()
    elif kind == "binary":
        out = (np.packbits(e > 0, axis=-1).astype(np.int16) - 128).astype(np.int8).tolist()
    elif kind == "base64":
        out = [base64.b64encode(row.astype("<f4").tobytes()).decode("ascii") for row in e]
    else:
        raise ValueError(f"unknown embedding type {kind!r}")
    return out
