"""--speculative-config: vLLM's keys, checked on construction; every error is one line naming the flag."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model")
METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 32  # verification rows per sequence per step; more never pays on a memory-bound decode
FLAG = "--speculative-config"


@dataclass(frozen=True)
class SpecConfig:
    method: str  # "ngram": prompt lookup; "draft_model": a smaller model proposes
    num_speculative_tokens: int  # the most draft tokens verified per sequence per step
    prompt_lookup_max: int = 5  # ngram: the longest suffix looked up in the prompt and the output so far
    prompt_lookup_min: int = 5  # ngram: the shortest
    model: str | None = None  # draft_model: its folder or GGUF file


def _int(raw: dict[str, Any], key: str) -> int | None:
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{FLAG}: {key} must be an integer, got {value!r}")
    return value


def parse_spec_config(raw: dict[str, Any]) -> SpecConfig | None:
    """The checked config, or None for an empty object (no speculation)."""
    if not raw:
        return None
    unknown = sorted(set(raw) - set(KEYS))
    if unknown:
        raise ValueError(f"{FLAG}: unknown key {unknown[0]!r}; known: {', '.join(KEYS)}")
    method = raw.get("method") or ("draft_model" if raw.get("model") else None)
    if method not in METHODS:
        raise ValueError(
            f'{FLAG}: method must be one of {", ".join(METHODS)} (or give a draft "model"), got {raw.get("method")!r}'
        )
    k = _int(raw, "num_speculative_tokens")
    if k is None or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"{FLAG}: num_speculative_tokens must be 1..{MAX_SPECULATIVE_TOKENS}, got {k}")
    if method == "draft_model":
        return _draft_model(raw, k)
    lo, hi = _int(raw, "prompt_lookup_min"), _int(raw, "prompt_lookup_max")
    lo, hi = (lo if lo is not None else hi or 5), (hi if hi is not None else lo or 5)  # vLLM: either sets both
    if not 1 <= lo <= hi:
        raise ValueError(f"{FLAG}: need 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo} and {hi}")
    return SpecConfig("ngram", k, hi, lo)


def _draft_model(raw: dict[str, Any], k: int) -> SpecConfig:
    model = raw.get("model")
    if not isinstance(model, str) or not model:
        raise ValueError(f'{FLAG}: method draft_model needs "model": the draft\'s folder or GGUF file')
    if not Path(model).exists():
        raise ValueError(f"{FLAG}: draft model {model!r} does not exist")
    return SpecConfig("draft_model", k, model=model)
