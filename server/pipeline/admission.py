"""Queued-request / queued-token limits (--max-num-queued-reqs, --max-num-queued-tokens) -> 503.

"Queued" means admitted and not yet given a first token. Pessimistic: a request's whole prompt counts
until its first token arrives, whatever part of it the engine has already prefilled. Pure bookkeeping,
no I/O; callers pair every successful try_admit with exactly one first_token or release.
"""

from __future__ import annotations


def min_tokens(text: str, max_token_bytes: int) -> int:
    """A lower bound on the tokens of `text`, to refuse before tokenizing only when a limit is surely exceeded.

    `max_token_bytes` is the longest token's UTF-8 length (128 for Qwen2, 24 for Llama 2's vocabulary).
    A normalizer may shrink text (NFC composes Hangul jamo 3:1), so each token covers at most
    3 * max_token_bytes bytes of the original text.
    """
    return -(-len(text.encode("utf-8", "surrogatepass")) // (3 * max_token_bytes))


class Admission:
    """Counts queued requests and their prompt tokens against optional limits (None: unlimited)."""

    def __init__(self, max_num_queued_reqs: int | None, max_num_queued_tokens: int | None) -> None:
        limits = (("--max-num-queued-reqs", max_num_queued_reqs), ("--max-num-queued-tokens", max_num_queued_tokens))
        for flag, value in limits:
            if value is not None and value < 0:
                raise ValueError(f"{flag} must be >= 0 or unset, got {value}")
        self._max_reqs = max_num_queued_reqs
        self._max_tokens = max_num_queued_tokens
        self._reqs = 0
        self._tokens = 0

    @property
    def queued_reqs(self) -> int:
        return self._reqs

    @property
    def queued_tokens(self) -> int:
        return self._tokens

    def try_admit(self, num_reqs: int, num_tokens: int) -> str | None:
        """Admit `num_reqs` requests holding `num_tokens` prompt tokens in all; None if admitted, else why not."""
        reason = self._refusal(num_reqs, num_tokens, "")
        if reason is None:
            self._reqs += num_reqs
            self._tokens += num_tokens
        return reason

    def would_refuse(self, num_reqs: int, min_num_tokens: int) -> str | None:
        """Why try_admit would surely refuse requests holding at least `min_num_tokens` tokens now, else None.

        Admits nothing: the routes ask before tokenizing, the exact try_admit runs once the prompt is tokenized.
        """
        return self._refusal(num_reqs, min_num_tokens, "at least ")

    def _refusal(self, num_reqs: int, num_tokens: int, bound: str) -> str | None:
        return self._refusal_at(self._reqs, self._tokens, num_reqs, num_tokens, bound)

    def _refusal_at(self, queued_reqs: int, queued_tokens: int, num_reqs: int, num_tokens: int,
                    bound: str) -> str | None:
        """Why `num_reqs` / `num_tokens` more do not fit beside `queued_reqs` / `queued_tokens`, else None."""
        if num_reqs < 0 or num_tokens < 0:
            raise ValueError(f"cannot admit {num_reqs} requests with {num_tokens} tokens")
        if self._max_reqs is not None and queued_reqs + num_reqs > self._max_reqs:
            if num_reqs > self._max_reqs:
                return (f"the request needs {num_reqs} queue slots but --max-num-queued-reqs is {self._max_reqs}; "
                        "send fewer choices (n) per request")
            return (f"too many queued requests ({queued_reqs} queued, limit {self._max_reqs}); retry later")
        if self._max_tokens is not None and queued_tokens + num_tokens > self._max_tokens:
            if num_tokens > self._max_tokens:
                return (f"the request's prompt tokens ({bound}{num_tokens}, all choices) exceed "
                        f"--max-num-queued-tokens {self._max_tokens} on their own; "
                        "send a shorter prompt or fewer choices")
            return (f"too many queued prompt tokens ({queued_tokens} queued + {bound}{num_tokens} requested, "
                    f"limit {self._max_tokens}); retry later")
        return None

    def first_token(self, num_tokens: int) -> None:
        """One admitted request got its first token: it and its `num_tokens` prompt tokens stop counting."""
        self.release(1, num_tokens)

    def release(self, num_reqs: int, num_tokens: int) -> None:
        """Admitted requests ended before their first token (abort, error, disconnect)."""
        if num_reqs < 0 or num_tokens < 0 or num_reqs > self._reqs or num_tokens > self._tokens:
            raise RuntimeError(
                f"releasing {num_reqs} requests / {num_tokens} tokens but only {self._reqs} / {self._tokens} "
                "are queued: a request was released twice or never admitted"
            )
        self._reqs -= num_reqs
        self._tokens -= num_tokens
