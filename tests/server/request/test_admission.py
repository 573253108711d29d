"""Admission limits at, just under and just over each limit; token-count bounds against real tokenizers."""

from __future__ import annotations

import unicodedata

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from demo.tokenizers import load_tokenizer
from server.request.admission import Admission, AdmissionTicket, min_tokens

# Tokens a tokenizer may add around a text (bos/eos, a SentencePiece dummy-prefix piece).
SPECIAL_TOKEN_ALLOWANCE = 8


def estimate_tokens(text: str) -> int:
    """An upper bound on the number of tokens `text` encodes to: its UTF-8 byte length + SPECIAL_TOKEN_ALLOWANCE.

    The bound holds for byte-level BPE (Qwen2, Llama 3, tiktoken-style) and SentencePiece with byte fallback
    (Llama 2, Mistral): every token covers at least one byte of the text, and the SentencePiece space marker
    "▁" stands for one byte. It can be exceeded only by a normalizer that lengthens text: NFC rewrites a few
    rare characters (e.g. U+0958) into up to 3 code points.
    """
    return len(text.encode("utf-8", "surrogatepass")) + SPECIAL_TOKEN_ALLOWANCE


def test_request_limit_at_under_over() -> None:
    adm = Admission(max_num_queued_reqs=3, max_num_queued_tokens=None)
    assert adm.try_admit(1, 10) is None
    assert adm.try_admit(1, 10) is None  # 2 queued: just under
    assert adm.try_admit(1, 10) is None  # 3 queued: at the limit
    reason = adm.try_admit(1, 10)  # just over
    assert reason is not None and "queued requests" in reason
    assert (adm.queued_reqs, adm.queued_tokens) == (3, 30)  # a refusal changes nothing
    adm.first_token(10)
    assert (adm.queued_reqs, adm.queued_tokens) == (2, 20)
    assert adm.try_admit(1, 10) is None


def test_multi_request_admission_counts_all_children() -> None:
    adm = Admission(max_num_queued_reqs=4, max_num_queued_tokens=None)
    assert adm.try_admit(3, 30) is None
    assert adm.try_admit(2, 20) is not None  # 5 > 4
    assert adm.try_admit(1, 10) is None  # exactly 4
    reason = Admission(2, None).try_admit(3, 1)
    assert reason is not None and "n" in reason and "retry" not in reason  # can never fit: no point retrying


def test_token_limit_at_under_over() -> None:
    adm = Admission(max_num_queued_reqs=None, max_num_queued_tokens=100)
    assert adm.try_admit(1, 60) is None
    assert adm.try_admit(1, 39) is None  # 99: just under
    assert adm.try_admit(1, 1) is None  # 100: at the limit
    reason = adm.try_admit(1, 1)  # 101: just over
    assert reason is not None and "prompt tokens" in reason and "retry later" in reason
    adm.release(1, 39)
    assert (adm.queued_reqs, adm.queued_tokens) == (2, 61)
    assert adm.try_admit(1, 39) is None
    assert adm.try_admit(1, 1) is not None


def test_prompt_larger_than_token_limit_alone() -> None:
    adm = Admission(max_num_queued_reqs=None, max_num_queued_tokens=100)
    assert adm.try_admit(1, 100) is None
    adm.first_token(100)
    reason = adm.try_admit(1, 101)
    assert reason is not None and "on their own" in reason
    assert adm.queued_tokens == 0


def test_ticket_holds_a_lower_bound_then_the_exact_count() -> None:
    """A route's ticket: refused with the bound's wording before tokenizing, resized in place once exact."""
    adm = Admission(max_num_queued_reqs=2, max_num_queued_tokens=100)
    probe = AdmissionTicket(adm)
    assert probe.resize(2, 100, "at least ") is None
    assert (adm.queued_reqs, adm.queued_tokens) == (2, 100)  # a ticket's bound is held, not only checked
    probe.release()
    assert (adm.queued_reqs, adm.queued_tokens) == (0, 0)
    assert adm.try_admit(1, 60) is None
    ticket = AdmissionTicket(adm)
    reason = ticket.resize(3, 1, "at least ")
    assert reason is not None and "3 queue slots" in reason and "retry" not in reason
    reason = ticket.resize(1, 101, "at least ")
    assert reason is not None and "at least 101" in reason and "on their own" in reason
    reason = ticket.resize(1, 41, "at least ")
    assert reason is not None and "60 queued + at least 41" in reason and "retry later" in reason
    assert ticket.held == (0, 0) and (adm.queued_reqs, adm.queued_tokens) == (1, 60)  # refusals hold nothing
    assert ticket.resize(1, 10, "at least ") is None
    reason = ticket.settle({"r-0": 41})  # the exact count, checked beside the others only
    assert reason is not None and "60 queued + 41 requested" in reason
    assert ticket.held == (1, 10) and (adm.queued_reqs, adm.queued_tokens) == (2, 70)  # still its bound
    assert ticket.settle({"r-0": 40}) is None
    assert (adm.queued_reqs, adm.queued_tokens) == (2, 100)
    reason = AdmissionTicket(adm).resize(1, 0, "at least ")
    assert reason is not None and "queued requests" in reason
    ticket.first_token("r-0")
    assert ticket.held == (0, 0) and (adm.queued_reqs, adm.queued_tokens) == (1, 60)
    ticket.release()  # nothing left: gives back nothing, however often it is called
    ticket.release()
    assert (adm.queued_reqs, adm.queued_tokens) == (1, 60)


def test_ticket_released_once_by_its_with_unless_detached() -> None:
    adm = Admission(max_num_queued_reqs=None, max_num_queued_tokens=100)
    with AdmissionTicket(adm) as ticket:
        assert ticket.resize(2, 30) is None
        assert ticket.settle({"a": 20, "b": 20}) is None
        ticket.first_token("a")
        ticket.first_token("a")  # a second first token of one request gives back nothing more
        assert (adm.queued_reqs, adm.queued_tokens) == (1, 20)
    assert (adm.queued_reqs, adm.queued_tokens) == (0, 0)
    ticket.release()  # released already: no second release reaches the limits (they would raise)
    with AdmissionTicket(adm) as moved:
        assert moved.resize(1, 5) is None
        moved.detach()  # a background task owns it now
    assert (adm.queued_reqs, adm.queued_tokens) == (1, 5)
    moved.release()
    assert (adm.queued_reqs, adm.queued_tokens) == (0, 0)
    free = AdmissionTicket(None)  # no limits: bookkeeping only
    assert free.resize(3, 10**9) is None and free.settle({"x": 1}) is None and free.held == (1, 1)


def test_zero_limits_and_no_limits() -> None:
    assert Admission(0, None).try_admit(1, 0) is not None
    assert Admission(None, 0).try_admit(1, 0) is None  # an empty prompt holds no tokens
    assert Admission(None, 0).try_admit(1, 1) is not None
    free = Admission(None, None)
    for _ in range(1000):
        assert free.try_admit(1, 10**6) is None
    assert (free.queued_reqs, free.queued_tokens) == (1000, 10**9)


def test_first_token_and_release_return_to_zero() -> None:
    adm = Admission(2, 50)
    assert adm.try_admit(1, 20) is None
    assert adm.try_admit(1, 30) is None
    adm.first_token(20)
    adm.release(1, 30)
    assert (adm.queued_reqs, adm.queued_tokens) == (0, 0)
    with pytest.raises(RuntimeError, match="released twice"):
        adm.release(1, 0)
    with pytest.raises(RuntimeError):
        adm.first_token(1)


def test_negative_limit_refused() -> None:
    with pytest.raises(ValueError, match="max-num-queued-tokens"):
        Admission(None, -1)


_TOKENIZERS: dict[str, tuple[tokenizers.Tokenizer, int]] = {}


def _tok(family: str) -> tuple[tokenizers.Tokenizer, int]:
    if family not in _TOKENIZERS:
        _TOKENIZERS[family] = (load_tokenizer(family), {"qwen2": 128, "llama": 24}[family])  # type: ignore[arg-type]
    return _TOKENIZERS[family]


def _nfc_keeps_length(c: str) -> bool:
    return len(unicodedata.normalize("NFC", c).encode()) <= len(c.encode())


# Any text but the few characters NFC lengthens (composition exclusions such as U+0958, U+0F76): documented.
_PLAIN_TEXT = st.text(st.characters(codec="utf-8").filter(_nfc_keeps_length), max_size=200)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
@settings(max_examples=150, deadline=None)
@given(text=_PLAIN_TEXT)
def test_token_bounds_hold_for_real_tokenizers(family: str, text: str) -> None:
    tok, max_token_bytes = _tok(family)
    n = len(tok.encode(text, add_special_tokens=True).ids)
    assert min_tokens(text, max_token_bytes) <= n <= estimate_tokens(text)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_token_bounds_on_prose_code_and_cjk(family: str) -> None:
    tok, max_token_bytes = _tok(family)
    texts = [
        "Hello, world! " * 50,
        "def f(x):\n    return x ** 2\n" * 30,
        "数据科学是一门学科。" * 40,
        " " * 300,
        "\x00" * 9,
    ]
    for text in texts:
        n = len(tok.encode(text, add_special_tokens=True).ids)
        assert min_tokens(text, max_token_bytes) <= n <= estimate_tokens(text), text[:20]
