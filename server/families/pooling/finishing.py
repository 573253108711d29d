"""A pooled output's finishing, per request, as vLLM and the reference libraries do it: an embedding cut to its
Matryoshka `dimensions` then L2-normalized (when normalizing), a classifier's logits through its activation."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

from engine.messages import PooledData, PoolingInfo
from server.http.errors import APIError, bad_request
from server.request.collector import Output

EPS = 1e-12  # torch.nn.functional.normalize's


def as_array(out: Output) -> np.ndarray:
    """The engine's raw float32 output of a finished request: [D], or [tokens, D] for ALL / STEP."""
    pooled: PooledData | None = out.pooled
    if pooled is None:
        raise APIError("the engine returned no pooled output; is it running with --runner pooling?", status=500)
    return np.frombuffer(pooled.data, dtype="<f4").reshape(pooled.shape)


def l2_normalize(v: np.ndarray) -> np.ndarray:
    """Each row (the last axis) to unit length, as F.normalize(p=2, eps=1e-12)."""
    norm = np.linalg.norm(v, axis=-1, keepdims=True)
    out: np.ndarray = (v / np.maximum(norm, EPS)).astype(np.float32)
    return out


def activate(v: np.ndarray, activation: str) -> np.ndarray:
    """softmax over the last axis, sigmoid, tanh, or identity; float32 as the engine's output."""
    x = v.astype(np.float64)
    if activation == "softmax":
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        x = e / e.sum(axis=-1, keepdims=True)
    elif activation == "sigmoid":
        x = 1.0 / (1.0 + np.exp(-x))
    elif activation == "tanh":
        x = np.tanh(x)
    return x.astype(np.float32)


def check_dimensions(requested: int | None, info: PoolingInfo, param: str) -> int | None:
    """A Matryoshka cut, checked against the model's declaration (config.json or --pooler-config): 400s."""
    if requested is None:
        return None
    allowed = info.matryoshka_dimensions
    if not info.is_matryoshka and allowed is None:
        raise bad_request(
            f"This model does not support Matryoshka representation, so {param} cannot change the "
            f"embedding size; leave {param} out (a checkpoint declares it with config.json's "
            "matryoshka_dimensions, or the server with --pooler-config "
            "'{\"is_matryoshka\": true}').",
            param,
        )
    if not 1 <= requested <= info.hidden_size:
        raise bad_request(f"{param} must be between 1 and {info.hidden_size}, got {requested}.", param)
    if allowed is not None and requested not in allowed:
        raise bad_request(f"This model supports {param} {sorted(allowed)} only, got {requested}.", param)
    return requested


def embedding(out: Output, dimensions: int | None, normalize: bool) -> np.ndarray:
    """An embedding as served: cut to `dimensions`, then normalized (the row of each token for ALL / STEP)."""
    v = as_array(out)
    if dimensions is not None:
        v = v[..., :dimensions]
    return l2_normalize(v) if normalize else v


def class_scores(out: Output, info: PoolingInfo, use_activation: bool | None) -> np.ndarray:
    """A classifier's per-label scores: its activation (config.json's problem type) unless turned off."""
    v = as_array(out)
    on = info.use_activation if use_activation is None else use_activation
    return activate(v, info.activation) if on else v


def encode_vector(v: np.ndarray, b64: bool) -> Any:
    """JSON floats (nested for a matrix), or base64 of the little-endian float32 values, row after row."""
    if b64:
        return base64.b64encode(np.ascontiguousarray(v, dtype="<f4").tobytes()).decode("ascii")
    return v.tolist()
