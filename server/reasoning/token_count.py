"""How many of an answer's tokens were reasoning (usage's reasoning_tokens), from its token ids as generated.

The reasoning parser splits text, not tokens; the count is the number of leading generated tokens that wrote
the reasoning through its end tag (the tags count: neither is visible text). Found by bisection over decoded
prefixes (the smallest prefix whose text holds the end tag), so no text is tokenized again and a token that
writes the end tag together with answer text counts once, as reasoning. Reasoning never closed (cut by the
token limit): every token; no reasoning: none.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from server.reasoning.parser import ReasoningParser

Decode = Callable[[list[int]], str]


def decoder(tokenizer: Any, skip_special_tokens: bool) -> Decode:
    """Token ids -> text as a request's detokenizer writes it (the same special tokens skipped)."""
    return lambda ids: str(tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))


def reasoning_tokens(parser: ReasoningParser | None, ids: list[int], decode: Decode) -> int:
    if parser is None:
        return 0
    if not parser.ended:
        return len(ids) if parser.reasoning_open else 0
    lo, hi = 1, len(ids)  # the end tag is in decode(ids[:hi]); the smallest such prefix
    while lo < hi:
        mid = (lo + hi) // 2
        if parser.end in decode(ids[:mid]):
            hi = mid
        else:
            lo = mid + 1
    return hi
