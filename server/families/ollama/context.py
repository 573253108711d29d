"""/api/generate's `context`: the token ids of a previous exchange (its prompt's and its answer's, as the last
line of a templated /api/generate gives them), which the next request's prompt continues. As in Ollama: raw mode
neither takes nor gives one."""

from __future__ import annotations

import tokenizers

from server.http.errors import bad_request
from server.request.input_processor import ModelLimits


def checked_context(context: list[int] | None, raw: bool, limits: ModelLimits) -> list[int] | None:
    """The request's `context` (None when absent or empty); 400 in raw mode, for an id outside the vocabulary,
    or for one that leaves no room in the model's context."""
    if not context:
        return None
    if raw:
        raise bad_request("raw mode does not take a context: drop raw, or put the whole text in prompt.", "context")
    bad = next((i for i, t in enumerate(context) if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise bad_request(
            f"context[{bad}] is {context[bad]}, not a token id of this model (0 to {limits.vocab_size - 1}): send "
            "back the context a previous /api/generate answered.",
            "context",
        )
    if len(context) >= limits.max_model_len:
        raise bad_request(
            f"context holds {len(context)} tokens, but this model's context (max_model_len) is "
            f"{limits.max_model_len}: start a new conversation without it.",
            "context",
        )
    return context


def _special_prefix(tokenizer: tokenizers.Tokenizer) -> list[int]:
    """The ids the tokenizer puts before every text (a BOS), found by encoding one with and without them."""
    full = tokenizer.encode("a").ids
    plain = tokenizer.encode("a", add_special_tokens=False).ids
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return list(full[:start])
    return []


def continued(context: list[int] | None, ids: list[int], tokenizer: tokenizers.Tokenizer) -> list[int]:
    """The prompt's ids after the context's (the new part's leading BOS dropped: the context has its own)."""
    if context is None:
        return ids
    prefix = _special_prefix(tokenizer)
    if prefix and ids[: len(prefix)] == prefix:
        ids = ids[len(prefix) :]
    return [*context, *ids]
