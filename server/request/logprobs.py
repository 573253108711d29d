"""Engine logprobs (token ids) -> OpenAI's two logprobs shapes (chat and completions)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.messages import TokenLogprobs
from server.request.openai_protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob

_CACHE_LIMIT = 1 << 16
# A masked token's logprob is -inf (a grammar or allowed_token_ids left fewer tokens than asked for); JSON
# has no -inf, so it is written as vLLM writes it.
_FLOOR = -9999.0


def _finite(logprob: float) -> float:
    return logprob if logprob > _FLOOR else _FLOOR


class TokenTexts:
    """Text of single token ids, cached: logprobs name every token and its alternatives."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._cache) >= _CACHE_LIMIT:
                self._cache.clear()
            self._cache[token_id] = text
        return text


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def chat_logprobs(entries: Sequence[TokenLogprobs], texts: TokenTexts) -> ChatLogprobs:
    content = []
    for e in entries:
        token = texts(e.token_id)
        top = [TopLogprob(texts(t), _finite(lp), _bytes(texts(t))) for t, lp in zip(e.top_ids, e.top_logprobs)]
        content.append(ChatTokenLogprob(token, _finite(e.logprob), _bytes(token), top))
    return ChatLogprobs(content)


def completion_logprobs(
    entries: Sequence[TokenLogprobs | None],
    texts: TokenTexts,
    offset: int,
    out: CompletionLogprobs | None = None,
    none_token: str = "",
) -> tuple[CompletionLogprobs, int]:
    """Append `entries` to `out` (or a new one); returns it and the text offset after the last token.

    A None entry (the first prompt token, which has no logprob) is `none_token` with null logprobs.
    """
    out = out if out is not None else CompletionLogprobs()
    for e in entries:
        if e is None:
            out.tokens.append(none_token)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            out.text_offset.append(offset)
            offset += len(none_token)
            continue
        token = texts(e.token_id)
        out.tokens.append(token)
        out.token_logprobs.append(_finite(e.logprob))
        top = {token: _finite(e.logprob)}
        for t, lp in zip(e.top_ids, e.top_logprobs):
            top.setdefault(texts(t), _finite(lp))
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(token)
    return out, offset
