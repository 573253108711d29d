"""server/request/detokenizer.py against tokenizer.decode on real tokenizers (qwen2, llama, tekken)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import tokenizers

from demo.tokenizers import load_tokenizer
from server.request.detokenizer import DetokenizeError, IncrementalDetokenizer, _alone_lengths, _tokenizer_info

FAMILIES = ["qwen2", "llama", "tekken"]
TEXT = " Hello 你好 👨\u200d👩\u200d👧 🇫🇷 wörld e\u0301 שלום!\n\n  end"


def reference(tok: tokenizers.Tokenizer, prompt: list[int], gen: list[int], skip: bool = True) -> str:
    head = tok.decode(prompt, skip_special_tokens=skip)
    full = tok.decode(prompt + gen, skip_special_tokens=skip)
    assert full.startswith(head)
    return full[len(head) :]


def stream(
    tok: tokenizers.Tokenizer, prompt: list[int], gen: list[int], step: int = 1, **kw: object
) -> tuple[list[str], IncrementalDetokenizer, str | None]:
    d = IncrementalDetokenizer(tok, prompt, **kw)  # type: ignore[arg-type]
    deltas: list[str] = []
    reason = None
    for i in range(0, max(len(gen), 1), step):
        last = i + step >= len(gen)
        reason = d.update(gen[i : i + step], last)
        deltas.append(d.take_delta())
        if reason is not None or last:
            break
    return deltas, d, reason


def ids(family: str, text: str) -> list[int]:
    return load_tokenizer(family).encode(text, add_special_tokens=False).ids  # type: ignore[arg-type]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("step", [1, 3, 100])
def test_stream_matches_reference(family: str, step: int) -> None:
    tok = load_tokenizer(family)  # type: ignore[arg-type]
    prompt = tok.encode("Say:").ids
    gen = ids(family, TEXT)
    deltas, d, reason = stream(tok, prompt, gen, step)
    assert reason is None and d.finished
    assert "".join(deltas) == d.output_text == reference(tok, prompt, gen)
    assert d.num_output_tokens == len(gen)
    assert all("\ufffd" not in x for x in deltas)  # never part of a character


def test_sentencepiece_leading_space_follows_the_prompt() -> None:
    tok = load_tokenizer("llama")
    gen = ids("llama", "world")  # one piece, "▁world"
    # After a prompt the piece keeps its space; with no prompt it is dropped, as decode(gen) does.
    assert stream(tok, ids("llama", "Hello"), gen)[1].output_text == " world"
    assert stream(tok, [], gen)[1].output_text == "world" == tok.decode(gen)
    assert stream(tok, [1], gen)[1].output_text == "world"  # only <s>: skipped, so same as empty


@pytest.mark.parametrize("family", FAMILIES)
def test_special_tokens_skipped_or_kept(family: str) -> None:
    tok = load_tokenizer(family)  # type: ignore[arg-type]
    eos = 151645 if family == "qwen2" else 2
    gen = ids(family, "a 你") + [eos] + ids(family, "好 b")
    for skip in (True, False):
        deltas, d, _ = stream(tok, [], gen, skip_special_tokens=skip)
        assert "".join(deltas) == d.output_text == reference(tok, [], gen, skip)
    assert tok.id_to_token(eos) in stream(tok, [], gen, skip_special_tokens=False)[1].output_text


def test_byte_fallback_run_is_held_until_it_ends() -> None:
    """A later byte token can turn a whole run of byte-fallback tokens into U+FFFDs."""
    tok = load_tokenizer("llama")
    b = [tok.token_to_id(f"<0x{x:02X}>") for x in "你".encode() + b"\xe4"]
    gen = b + ids("llama", "x")
    deltas, d, _ = stream(tok, ids("llama", "Hi"), gen)
    assert d.output_text == reference(tok, ids("llama", "Hi"), gen) == "\ufffd" * 4 + " x"
    assert "你" not in "".join(deltas)


def test_text_ending_in_replacement_char_is_flushed_at_finish() -> None:
    tok = load_tokenizer("qwen2")
    gen = ids("qwen2", "ok \ufffd")
    deltas, d, _ = stream(tok, [], gen)
    assert d.output_text == "ok \ufffd" == "".join(deltas)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_straddling_tokens(family: str, include: bool) -> None:
    tok = load_tokenizer(family)  # type: ignore[arg-type]
    gen = ids(family, "The answer is 你好世界 and more text after it")
    deltas, d, reason = stream(tok, [], gen, stop=["好世", "zzz"], include_stop_str_in_output=include)
    assert reason == "好世"
    expected = "The answer is 你好世" if include else "The answer is 你"
    assert "".join(deltas) == d.output_text == expected
    assert d.finished and d.update(ids(family, "more"), False) is None and d.take_delta() == ""


def test_held_back_text_is_at_most_longest_stop_minus_one() -> None:
    tok = load_tokenizer("qwen2")
    gen = ids("qwen2", "abcdefghijklmnopqrstuvwxyz")
    d = IncrementalDetokenizer(tok, [], stop=["12345"])
    sent = ""
    for i, t in enumerate(gen):
        d.update([t], False)
        sent += d.take_delta()
        assert len(reference(tok, [], gen[: i + 1])) - len(sent) <= 4
    d.update([], True)
    assert sent + d.take_delta() == "abcdefghijklmnopqrstuvwxyz"


def test_earliest_match_wins_even_if_a_later_one_completes_first() -> None:
    """ "c" is complete before "abcd" can be, but "abcd" starts earlier: wait for it."""
    tok = load_tokenizer("qwen2")
    gen = [tok.token_to_id(c) for c in "xabcdy"]
    for step in (1, 6):
        _, d, reason = stream(tok, [], gen, step, stop=["c", "abcd"])
        assert (d.output_text, reason) == ("x", "abcd")
    # Ties at one position go to the stop listed first.
    assert stream(tok, [], gen, 1, stop=["ab", "abc"], include_stop_str_in_output=True)[1].output_text == "xab"
    assert stream(tok, [], gen, 1, stop=["abc", "ab"], include_stop_str_in_output=True)[1].output_text == "xabc"


def test_min_tokens_protects_early_text_from_stops() -> None:
    tok = load_tokenizer("qwen2")
    gen = [tok.token_to_id(c) for c in "abXabX"]
    assert stream(tok, [], gen, stop=["X"])[1].output_text == "ab"
    assert stream(tok, [], gen, stop=["X"], min_tokens=3)[1].output_text == "abXab"
    assert stream(tok, [], gen, 6, stop=["X"], min_tokens=3)[1].output_text == "abXab"
    # A stop straddling the min_tokens boundary starts before it: not a match.
    assert stream(tok, [], gen, stop=["Xa"], min_tokens=3)[1].output_text == "abXabX"


def test_regression_stops_ignored_when_fewer_than_min_tokens() -> None:
    """Found by fuzz: the request finished before min_tokens tokens, so no stop string applies."""
    tok = load_tokenizer("llama")
    deltas, d, reason = stream(
        tok, [1, 28705, 29142, 29119], [2, 2, 3], stop=["\x00"], min_tokens=4, skip_special_tokens=False
    )
    assert reason is None and d.output_text == "</s></s>\x00" == "".join(deltas)


def test_regression_step_ending_mid_character_holds_whole_window() -> None:
    """Found by fuzz: a step ending inside a character releases nothing of that step, later all of it."""
    tok = load_tokenizer("qwen2")
    gen = [101862, 250, 236, 101862, 251, 117]  # two astral CJK characters, 3 tokens each
    deltas, d, _ = stream(tok, [48, 25, 220], gen, 2, stop=["Q"])
    assert d.output_text == reference(tok, [48, 25, 220], gen) == "".join(deltas)


@pytest.mark.parametrize("bad", [[-1], [151646], [10**20], [5, -3]])
def test_bad_ids_raise_detokenize_error(bad: list[int]) -> None:
    tok = load_tokenizer("qwen2")
    with pytest.raises(DetokenizeError, match="outside the tokenizer's vocabulary"):
        IncrementalDetokenizer(tok, []).update(bad, False)
    with pytest.raises(DetokenizeError):
        IncrementalDetokenizer(tok, bad)


def test_empty_stop_strings_are_ignored() -> None:
    tok = load_tokenizer("qwen2")
    gen = ids("qwen2", "hello")
    stops: Sequence[str] = ["", "zz"]
    assert stream(tok, [], gen, stop=stops)[1].output_text == "hello"


def test_updates_after_the_request_is_done_are_ignored() -> None:
    """Found by the atheris harness (a harness bug): ids after a stop are never consumed or checked."""
    tok = load_tokenizer("qwen2")
    d = IncrementalDetokenizer(tok, [], stop=["b"])
    assert d.update(ids("qwen2", "a b c"), False) == "b"
    assert d.update([-1], True) is None and d.output_text == "a " and d.num_output_tokens == len(ids("qwen2", "a b c"))


class _CountingTokenizer:
    """Forwards to a tokenizer, counting decode calls and the longest id list decoded."""

    def __init__(self, tok: tokenizers.Tokenizer) -> None:
        self._tok = tok
        self.calls = 0
        self.longest = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self._tok, name)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.calls += 1
        self.longest = max(self.longest, len(ids))
        return str(self._tok.decode(ids, skip_special_tokens=skip_special_tokens))


def _token_id(tok: tokenizers.Tokenizer, token: str) -> int:
    found = tok.token_to_id(token)
    assert found is not None, token
    return found


def _continuation_byte_ids(family: str) -> list[int]:
    """The 64 one-byte tokens for bytes 0x80-0xBF: a lone one never completes a character."""
    tok = load_tokenizer(family)  # type: ignore[arg-type]
    if family == "llama":
        return [_token_id(tok, f"<0x{b:02X}>") for b in range(0x80, 0xC0)]
    # Byte-level BPE writes bytes 0x80-0xA0 as U+0122.. and 0xA1-0xBF as themselves (0xAD as U+0143).
    chars = [chr(0x122 + b - 0x80) if b <= 0xA0 else "\u0143" if b == 0xAD else chr(b) for b in range(0x80, 0xC0)]
    found = [_token_id(tok, c) for c in chars]
    assert all(tok.decode([i]) == "\ufffd" for i in found)
    return found


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kw", [{}, {"stop": ["x"], "min_tokens": 5000}])
def test_run_that_never_completes_a_character_costs_bounded_work(family: str, kw: dict[str, object]) -> None:
    """10,000 lone continuation bytes: a few decodes of a short window per token (not the whole run each
    time, which was quadratic), U+FFFDs streamed as they become final, text equal to tokenizer.decode."""
    tok = load_tokenizer(family)  # type: ignore[arg-type]
    cont = _continuation_byte_ids(family)
    gen = [cont[k % len(cont)] for k in range(10_000)]
    prompt = tok.encode("Say:").ids
    counting = _CountingTokenizer(tok)
    d = IncrementalDetokenizer(counting, prompt, **kw)  # type: ignore[arg-type]
    counting.calls = counting.longest = 0
    sent = ""
    for k, t in enumerate(gen):
        d.update([t], k == len(gen) - 1)
        sent += d.take_delta()
        if k == 99:
            assert len(sent) >= 90  # streamed, not held to the end
    assert sent == d.output_text == reference(tok, prompt, gen) == "\ufffd" * len(gen)
    assert counting.calls <= 3 * len(gen) and counting.longest <= 16


def test_valid_byte_fallback_run_is_held_without_a_decode_per_token() -> None:
    """A valid run's text is not final (a later byte can void it), but holding it costs no decode per token."""
    tok = load_tokenizer("llama")
    byte = {b: _token_id(tok, f"<0x{b:02X}>") for b in range(256)}
    gen = [byte[b] for b in ("你好" * 1500).encode()] + ids("llama", "x")
    counting = _CountingTokenizer(tok)
    d = IncrementalDetokenizer(counting, ids("llama", "Hi"))  # type: ignore[arg-type]
    counting.calls = 0
    for t in gen[:-1]:
        assert d.next_delta([t]) == ""
    assert counting.calls == 0
    assert d.next_delta(gen[-1:]) == reference(tok, ids("llama", "Hi"), gen) == "你好" * 1500 + " x"
    assert counting.calls == 1
    # A byte that voids the run makes it final at once: one U+FFFD per byte, then one per byte after.
    d = IncrementalDetokenizer(tok, ids("llama", "Hi"))
    deltas = [d.next_delta([byte[b]]) for b in (0xE4, 0xBD, 0x41, 0xA0)]
    assert deltas == ["", "", "\ufffd" * 3, "\ufffd"]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_skip_table_from_one_scan_equals_a_decode_per_id(family: str) -> None:
    """The skip_special_tokens table is derived from the other one (special ids: 0); each id decoded alone agrees."""
    tok = load_tokenizer(family)
    info = _tokenizer_info(tok)
    assert info.special_ids  # the tables differ somewhere
    assert info.alone_len[1] == _alone_lengths(tok, info.vocab_size, True)
    assert info.alone_len[0] == _alone_lengths(tok, info.vocab_size, False)
