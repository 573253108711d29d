"""Incremental detokenization and stop strings for one request: pure, no I/O, O(1) amortized per token.

Reference text (what the concatenated deltas equal once finished): `decode(prompt + generated)` with
`decode(prompt)` cut off the front, special tokens dropped from both when `skip_special_tokens`.
With an empty prompt (or one made only of skipped special tokens) the reference is `decode(generated)`,
so a SentencePiece tokenizer drops the first piece's leading space, as it does at the start of any text.

How: decode a short window of ids, `[context token] + ids not yet committed`, and commit the window's
text past what the context token decodes to alone. A decode is local at a committed boundary, so the
text matches the reference. Text is held back (not committed) while the window ends in U+FFFD (a
character still incomplete) or, for byte-fallback tokenizers, while the last token is a byte token
(a later byte token can turn the whole run of byte tokens into U+FFFDs). `finished=True` commits all.

Bounded work per token, even for ids that never complete a character: text ending in U+FFFD is
committed up to a boundary once `SETTLE_TOKENS` more tokens follow it and the decode splits there
(UTF-8 decides a byte within 3 bytes, so that text can no longer change); a byte-fallback run is held
without decoding while its bytes are valid UTF-8 so far, and committed as soon as they are not (the
run then decodes to one U+FFFD per byte whatever follows).

Stop strings: the first match in the text (earliest start; at one start, the stop listed first) ends
the request; text after it (and the stop itself unless `include_stop_str_in_output`) is dropped. A
match may start only in text committed once `min_tokens` tokens were consumed (none if the request
ends sooner). Until then text is released at once; after it, the last `longest_stop - 1` characters
are held back until more text (or the finish) shows they start no match.

`spaces_between_special_tokens` is accepted for API parity but has no effect: fast tokenizers' decode
(the reference) has no such option.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass

import tokenizers

_REPLACEMENT = "\ufffd"
SETTLE_TOKENS = 4  # tokens after a boundary that fix the text before it: a UTF-8 character has at most 4 bytes
_SETTLE_SCAN = 8  # boundaries tried per step when settling: covers steps of up to 8 tokens
_Utf8Decoder = codecs.getincrementaldecoder("utf-8")


class DetokenizeError(ValueError):
    """The engine produced ids the tokenizer cannot decode; the request fails, the server goes on."""


@dataclass(frozen=True)
class _TokenizerInfo:
    vocab_size: int
    special_ids: frozenset[int]
    byte_ids: frozenset[int]  # byte-fallback tokens (<0xAB>); empty for byte-level BPE
    byte_values: dict[int, int]  # byte-fallback token id -> its byte
    bad_byte_id: int  # a byte token invalid alone (<0x80>): the context after an invalid run (-1: none)
    alone_len: tuple[list[int], list[int]]  # len(decode([id])) for every id, per skip_special_tokens


# Keyed by id(); the tokenizer is kept alive in the value so its id is never reused.
_INFO: dict[int, tuple[tokenizers.Tokenizer, _TokenizerInfo]] = {}


def _tokenizer_info(tok: tokenizers.Tokenizer) -> _TokenizerInfo:
    hit = _INFO.get(id(tok))
    if hit is not None and hit[0] is tok:
        return hit[1]
    special = frozenset(i for i, t in tok.get_added_tokens_decoder().items() if t.special)
    byte_values: dict[int, int] = {}
    if getattr(tok.model, "byte_fallback", False):
        found = ((tok.token_to_id(f"<0x{b:02X}>"), b) for b in range(256))
        byte_values = {i: b for i, b in found if i is not None}
    invalid_alone = [i for i, b in byte_values.items() if 0x80 <= b <= 0xBF or b in (0xC0, 0xC1) or b >= 0xF5]
    bad_byte_id = min(invalid_alone, default=-1)  # without one no run can turn invalid
    n = tok.get_vocab_size(with_added_tokens=True)
    shown = _alone_lengths(tok, n, False)
    # skip_special_tokens drops only the special ids, so one scan gives both tables (a scan: 0.14 s for Qwen2's)
    skipped = [0 if i in special else length for i, length in enumerate(shown)]
    info = _TokenizerInfo(n, special, frozenset(byte_values), byte_values, bad_byte_id, (shown, skipped))
    _INFO[id(tok)] = (tok, info)
    return info


def _alone_lengths(tok: tokenizers.Tokenizer, n: int, skip: bool) -> list[int]:
    """len(decode([i])) for every id, once per tokenizer (at startup): the next window's
    context length is then a list lookup, not a second decode per token. Single-threaded on
    purpose: decode_batch's thread pool would make every later fork (a renderer worker) warn."""

    def length(i: int) -> int:
        try:
            return len(tok.decode([i], skip_special_tokens=skip))
        except Exception:  # an id the tokenizer cannot decode fails the window's own decode first
            return 0

    return [length(i) for i in range(n)]


def prepare(tok: tokenizers.Tokenizer) -> None:
    """Build the per-tokenizer tables now (at startup) rather than in the first request."""
    _tokenizer_info(tok)


class IncrementalDetokenizer:
    """Turns one request's generated ids into text deltas, applying stop strings."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        prompt_token_ids: list[int],
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self._tok = tokenizer
        self._info = info = _tokenizer_info(tokenizer)
        self._skip = skip_special_tokens
        self._hidden = info.special_ids if skip_special_tokens else frozenset()
        self._byte_ids = info.byte_ids
        self._byte_values = info.byte_values
        # The window's trailing byte-fallback run: 0 none, 1 valid UTF-8 so far, 2 invalid (final: one U+FFFD a byte).
        self._run = 0
        self._utf8 = _Utf8Decoder()
        self._alone_len = info.alone_len[1 if skip_special_tokens else 0]
        self._stops = [s for s in stop if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._scan = 0  # absolute text position before which no stop string can start
        self._include_stop = include_stop_str_in_output
        self._min_tokens = max(0, min_tokens)
        self._num_tokens = 0
        self._done = False
        self._stop_reason: str | None = None
        # Absolute committed-text position from which stop strings may start; None until min_tokens.
        self._search_from: int | None = 0 if self._min_tokens == 0 else None
        self._pending = ""  # committed text not yet released (stop-string hold-back)
        self._released: list[str] = []
        self._released_len = 0
        self._delta: list[str] = []
        self._text_cache: str | None = ""

        self._check(prompt_token_ids)
        # Context: the prompt's last visible token, and a trailing byte-fallback run whole.
        self._window: list[int] = []
        for i in reversed(prompt_token_ids):
            if i not in self._hidden:
                self._window.append(i)
                if i not in info.byte_ids:
                    break
        self._window.reverse()
        self._track_bytes(self._window)
        self._ctx_n = len(self._window)  # leading window ids that are context, already committed
        self._ctx_chars = len(self._decode(self._window)) if self._window else 0

    # -- public ---------------------------------------------------------------------------------

    def update(self, new_token_ids: list[int], finished: bool) -> str | None:
        """Consume one engine step's ids; return the stop string that matched (the request is then
        done and text after it dropped), else None. `finished` releases everything held back.
        Calls after the request is done are ignored."""
        if self._done:
            return None
        self._check(new_token_ids)
        before = self._num_tokens
        self._num_tokens += len(new_token_ids)
        if self._search_from is None and self._num_tokens >= self._min_tokens:
            self._reach_min_tokens(new_token_ids[: self._min_tokens - before])
            new_token_ids = new_token_ids[self._min_tokens - before :]
        text = self._consume(new_token_ids, finished)
        if self._stops and self._search_from is not None:
            if text or finished:
                self._commit(text, finished)
        else:  # nothing here can start a stop string
            self._release(text)
        if finished:
            self._done = True
        return self._stop_reason

    def next_delta(self, new_token_ids: list[int]) -> str:
        """`update(ids, False)` then `take_delta()`, for a request without stop strings: the per-token path."""
        if self._done:
            return ""
        if self._stops:
            self.update(new_token_ids, False)
            return self.take_delta()
        self._check(new_token_ids)
        self._num_tokens += len(new_token_ids)
        self._release(self._consume(new_token_ids, False))
        return self.take_delta()

    def take_delta(self) -> str:
        """Text released since the last call ("" if none)."""
        if not self._delta:
            return ""
        out = self._delta[0] if len(self._delta) == 1 else "".join(self._delta)
        self._delta.clear()
        return out

    @property
    def output_text(self) -> str:
        """All text released so far; after a stop or finish, the final text."""
        if self._text_cache is None:
            self._text_cache = "".join(self._released)
            self._released = [self._text_cache]
        return self._text_cache

    @property
    def num_output_tokens(self) -> int:
        return self._num_tokens

    @property
    def finished(self) -> bool:
        """True once a stop string matched or `update(..., finished=True)` was called."""
        return self._done

    @property
    def stop_reason(self) -> str | None:
        """The stop string that ended the request, if any."""
        return self._stop_reason

    # -- internals ------------------------------------------------------------------------------

    def _check(self, ids: list[int]) -> None:
        if not ids:
            return
        n = self._info.vocab_size
        try:
            if min(ids) >= 0 and max(ids) < n:
                return  # the common case, checked in C; a float slipping through fails in decode
        except TypeError:
            pass
        for i in ids:
            if type(i) is not int or not 0 <= i < n:
                raise DetokenizeError(
                    f"token id {i!r} is outside the tokenizer's vocabulary (0..{n - 1}); "
                    "the model and tokenizer do not match: check --tokenizer and the checkpoint's vocab_size"
                )
        raise DetokenizeError(f"token ids must be integers, got {ids!r}")

    def _decode(self, ids: list[int]) -> str:
        try:
            return self._tok.decode(ids, skip_special_tokens=self._skip)
        except Exception as exc:  # tokenizers raises plain Exception subclasses; keep the contract narrow
            raise DetokenizeError(f"could not decode token ids: {exc}") from exc

    def _reach_min_tokens(self, ids: list[int]) -> None:
        """Stop strings may start only in text committed once the min_tokens-th token is consumed.

        Replaying the uncommitted ids one by one commits every stable token boundary, so that
        position does not depend on how the generation was split into engine steps."""
        replay = self._window[self._ctx_n :] + ids
        del self._window[self._ctx_n :]
        self._run = 0
        self._track_bytes(self._window)
        for i in replay:
            self._release(self._consume([i], False))
        self._search_from = self._scan = self._released_len + len(self._pending)

    def _consume(self, ids: list[int], finished: bool) -> str:
        """Add `ids` to the window; return the text it commits ("" while a character is incomplete)."""
        hidden = self._hidden
        if hidden:
            if len(ids) == 1:
                if ids[0] in hidden:
                    ids = []
            else:
                ids = [i for i in ids if i not in hidden]
        window = self._window
        if ids:
            window += ids
            if self._byte_values:
                self._track_bytes(ids)
        elif not finished or not window:
            return ""
        if self._run == 1 and not finished:
            return ""  # a valid byte-fallback run so far: a later byte may still void it all, decode once it ends
        try:
            text = self._tok.decode(window, skip_special_tokens=self._skip)
        except Exception as exc:  # tokenizers raises plain Exception subclasses; keep the contract narrow
            raise DetokenizeError(f"could not decode token ids: {exc}") from exc
        if not finished and text[-1:] == _REPLACEMENT and self._run != 2:
            # A character may still complete: wait, but commit what enough later tokens have fixed.
            return self._settle(text) if len(window) - self._ctx_n > SETTLE_TOKENS else ""
        # Rebase: the last token becomes the next window's context (an invalid run stays invalid through <0x80>).
        last = window[-1]
        if self._run == 2:
            last = self._info.bad_byte_id
        new_text = text[self._ctx_chars :]
        self._window = [last]
        self._ctx_n = 1
        self._ctx_chars = self._alone_len[last]
        return new_text

    def _settle(self, text: str) -> str:
        """Commit the window's text up to the last boundary with SETTLE_TOKENS tokens after it where the
        decode splits (`text` = decode(before) + what the rest decodes to after its context token); "" if none."""
        window = self._window
        alone = self._alone_len
        last_j = len(window) - SETTLE_TOKENS
        for j in range(last_j, max(self._ctx_n, last_j - _SETTLE_SCAN), -1):
            ctx = window[j - 1]
            if ctx in self._byte_ids:  # inside a byte-fallback run nothing is local
                continue
            head = self._decode(window[:j])
            if not text.startswith(head):
                continue
            tail = self._decode(window[j - 1 :])[alone[ctx] :]
            if len(head) + len(tail) != len(text) or not text.endswith(tail):
                continue
            del window[: j - 1]
            self._ctx_n = 1
            new_text = head[self._ctx_chars :]
            self._ctx_chars = alone[ctx]
            return new_text
        return ""

    def _track_bytes(self, ids: list[int]) -> None:
        """Follow the UTF-8 validity of the window's trailing byte-fallback run, one byte at a time."""
        values = self._byte_values
        for i in ids:
            b = values.get(i)
            if b is None:
                self._run = 0
                continue
            if self._run == 0:
                self._utf8.reset()
                self._run = 1
            if self._run == 1:
                try:
                    self._utf8.decode(bytes((b,)))
                except UnicodeDecodeError:
                    self._run = 2

    def _commit(self, text: str, finished: bool) -> None:
        pending = self._pending + text
        base = self._released_len  # absolute position of pending[0]
        start = max(self._search_from or 0, self._scan) - base
        best, best_k = -1, -1
        for k, s in enumerate(self._stops):
            at = pending.find(s, start)
            if at != -1 and (best == -1 or at < best):  # ties keep the stop listed first
                best, best_k = at, k
        undecided = -1
        if best != -1 and not finished:
            undecided = self._could_match_before(pending, start, best, best_k)
        if best != -1 and undecided == -1:
            s = self._stops[best_k]
            self._pending = ""
            self._release(pending[: best + len(s) if self._include_stop else best])
            self._stop_reason = s
            self._done = True
            return
        hold_from = len(pending) - self._hold
        self._scan = base + (undecided if undecided != -1 else max(start, hold_from))
        cut = len(pending) if finished else hold_from
        if cut > 0:
            self._pending = pending[cut:]
            self._release(pending[:cut])
        else:
            self._pending = pending

    def _could_match_before(self, pending: str, start: int, at: int, k_at: int) -> int:
        """First position <= `at` where a stop that would win over the match at `at` may still
        complete with more text (it runs off the end of `pending`), else -1."""
        n = len(pending)
        for y in range(max(start, n - self._hold), at + 1):
            tail = pending[y:]
            for k, s in enumerate(self._stops):
                if (y < at or k < k_at) and len(s) > len(tail) and s.startswith(tail):
                    return y
        return -1

    def _release(self, text: str) -> None:
        if text:
            self._released.append(text)
            self._released_len += len(text)
            self._delta.append(text)
            self._text_cache = None
