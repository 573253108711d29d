"""Queued-request / queued-token limits (--max-num-queued-reqs, --max-num-queued-tokens) -> 503.

"Queued" means admitted and not yet given a first token. Pessimistic: a request's whole prompt counts
until its first token arrives, whatever part of it the engine has already prefilled. Pure bookkeeping,
no I/O. One request holds one AdmissionTicket: taken before its prompt is rendered at a lower bound of its
tokens, resized as they become known, given back per engine request at its first token or at its end.
"""

from __future__ import annotations

from types import TracebackType
from typing import Protocol


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

    def try_admit(
        self, num_reqs: int, num_tokens: int, *, held: tuple[int, int] = (0, 0), bound: str = ""
    ) -> str | None:
        """Admit `num_reqs` requests holding `num_tokens` prompt tokens in all, in place of the `held` (requests,
        tokens) the caller's ticket holds already; None if admitted, else why not (and `held` stays held).
        `bound` "at least " words a refusal of a lower bound (a prompt not tokenized yet)."""
        reason = self._refusal_at(self._reqs - held[0], self._tokens - held[1], num_reqs, num_tokens, bound)
        if reason is None:
            self._reqs += num_reqs - held[0]
            self._tokens += num_tokens - held[1]
        return reason

    def _refusal_at(
        self, queued_reqs: int, queued_tokens: int, num_reqs: int, num_tokens: int, bound: str
    ) -> str | None:
        """Why `num_reqs` / `num_tokens` more do not fit beside `queued_reqs` / `queued_tokens`, else None."""
        if num_reqs < 0 or num_tokens < 0:
            raise ValueError(f"cannot admit {num_reqs} requests with {num_tokens} tokens")
        if self._max_reqs is not None and queued_reqs + num_reqs > self._max_reqs:
            if num_reqs > self._max_reqs:
                return (
                    f"the request needs {num_reqs} queue slots but --max-num-queued-reqs is {self._max_reqs}; "
                    "send fewer choices (n) per request"
                )
            return f"too many queued requests ({queued_reqs} queued, limit {self._max_reqs}); retry later"
        if self._max_tokens is not None and queued_tokens + num_tokens > self._max_tokens:
            if num_tokens > self._max_tokens:
                return (
                    f"the request's prompt tokens ({bound}{num_tokens}, all choices) exceed "
                    f"--max-num-queued-tokens {self._max_tokens} on their own; "
                    "send a shorter prompt or fewer choices"
                )
            return (
                f"too many queued prompt tokens ({queued_tokens} queued + {bound}{num_tokens} requested, "
                f"limit {self._max_tokens}); retry later"
            )
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


class AdmissionLike(Protocol):
    def try_admit(
        self, num_reqs: int, num_tokens: int, *, held: tuple[int, int] = (0, 0), bound: str = ""
    ) -> str | None: ...
    def first_token(self, num_tokens: int) -> None: ...
    def release(self, num_reqs: int, num_tokens: int) -> None: ...


class AdmissionTicket:
    """One request's hold on the limits (None: no limits), from before its prompt is rendered to its end.

    `resize` moves it to a new count (a lower bound before tokenizing, the exact count in AsyncLLM.generate):
    the one reservation grows or shrinks, refused when the new count would not fit. Each engine request's
    tokens stop counting at its first token; `release` gives back the rest, once, whoever calls it first (the
    holder's `with`, generate's clean-up, a background task).
    """

    def __init__(self, admission: AdmissionLike | None) -> None:
        self._admission = admission
        self._reqs = 0
        self._tokens = 0
        self._queued: dict[str, int] = {}  # engine request id -> its prompt tokens, once the count is exact
        self._detached = False

    @property
    def held(self) -> tuple[int, int]:
        """The requests and prompt tokens it holds now."""
        return self._reqs, self._tokens

    def resize(self, num_reqs: int, num_tokens: int, bound: str = "") -> str | None:
        """Hold `num_reqs` / `num_tokens` instead; None if they fit, else why not (what it held stays held)."""
        if self._admission is not None:
            reason = self._admission.try_admit(num_reqs, num_tokens, held=(self._reqs, self._tokens), bound=bound)
            if reason is not None:
                return reason
        self._reqs, self._tokens = num_reqs, num_tokens
        return None

    def settle(self, queued: dict[str, int]) -> str | None:
        """The exact count: each engine request's id and prompt tokens (given back one by one at first tokens)."""
        reason = self.resize(len(queued), sum(queued.values()))
        if reason is None:
            self._queued = dict(queued)
        return reason

    def first_token(self, request_id: str) -> None:
        n = self._queued.pop(request_id, None)
        if n is not None:
            self._reqs -= 1
            self._tokens -= n
            if self._admission is not None:
                self._admission.first_token(n)

    def release(self) -> None:
        if self._admission is not None and (self._reqs or self._tokens):
            self._admission.release(self._reqs, self._tokens)
        self._reqs = self._tokens = 0
        self._queued.clear()

    def detach(self) -> AdmissionTicket:
        """Hand it to a task that outlives the holder's `with`: that `with` no longer releases it, the task must."""
        self._detached = True
        return self

    def __enter__(self) -> AdmissionTicket:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        if not self._detached:
            self.release()
