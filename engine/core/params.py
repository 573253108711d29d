"""Engine-side validation of a request's sampling parameters.

The server validates first, with the API's messages; this guard exists so that nothing a frame carries
can crash the step loop (a refused request gets an error output, the others run on).
"""

from __future__ import annotations

import math

from engine.core.scheduler import RequestRefused
from engine.messages import SamplingParams

INT64_MAX = (1 << 63) - 1


def validate_params(p: SamplingParams, vocab_size: int) -> None:
    """Engine-side guard: the server validates too, but nothing a request carries may crash the engine."""
    floats = {
        "temperature": p.temperature,
        "top_p": p.top_p,
        "min_p": p.min_p,
        "presence_penalty": p.presence_penalty,
        "frequency_penalty": p.frequency_penalty,
        "repetition_penalty": p.repetition_penalty,
    }
    for name, value in floats.items():
        if not math.isfinite(value):
            raise RequestRefused(f"{name} must be a finite number, got {value}")
    checks = [
        (p.max_tokens >= 1, f"max_tokens must be at least 1, got {p.max_tokens}"),
        (p.temperature >= 0, f"temperature must be >= 0, got {p.temperature}"),
        (0 < p.top_p <= 1, f"top_p must be in (0, 1], got {p.top_p}"),
        (0 <= p.min_p <= 1, f"min_p must be in [0, 1], got {p.min_p}"),
        (p.top_k >= -1, f"top_k must be -1, 0 (off) or positive, got {p.top_k}"),
        (p.repetition_penalty > 0, f"repetition_penalty must be > 0, got {p.repetition_penalty}"),
        (0 <= p.min_tokens, f"min_tokens must be >= 0, got {p.min_tokens}"),
        (p.seed is None or -INT64_MAX - 1 <= p.seed <= INT64_MAX, "seed must fit in int64"),
        (p.logprobs is None or 0 <= p.logprobs <= vocab_size, "logprobs out of range"),
        (p.prompt_logprobs is None or 0 <= p.prompt_logprobs <= vocab_size, "prompt_logprobs out of range"),
    ]
    for ok, message in checks:
        if not ok:
            raise RequestRefused(message)
    ids = list(p.stop_token_ids) + list(p.allowed_token_ids or ()) + list(p.logit_bias or ())
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise RequestRefused(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    if p.logit_bias and not all(math.isfinite(v) for v in p.logit_bias.values()):
        raise RequestRefused("logit_bias values must be finite numbers")
    if p.allowed_token_ids is not None and not p.allowed_token_ids:
        raise RequestRefused("allowed_token_ids must not be empty")
