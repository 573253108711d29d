"""Property-based tests of server/request/detokenizer.py on real tokenizers (qwen2, llama, tekken).

Bounded for CI; raise SPINDLE_FUZZ_EXAMPLES (examples per property) for a longer run.
"""

from __future__ import annotations

import os

import pytest
from detok_support import (
    FRAGMENTS,
    FUZZ_FAMILIES,
    byte_ids,
    expected_output,
    reference_text,
    run_stream,
    single_byte_ids,
    special_ids,
    stable_prefix_len,
    tokenizer,
)
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from server.request.detokenizer import DetokenizeError, IncrementalDetokenizer

EXAMPLES = int(os.environ.get("SPINDLE_FUZZ_EXAMPLES", "80"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize="SPINDLE_FUZZ_EXAMPLES" not in os.environ,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

families = st.sampled_from(FUZZ_FAMILIES)
texts = st.lists(st.sampled_from(FRAGMENTS), max_size=24).map("".join)
steps = st.lists(st.integers(1, 6), min_size=1, max_size=8)


@st.composite
def random_ids(draw: st.DrawFn, family: str, max_size: int = 40) -> list[int]:
    """Ids over the whole vocabulary, with special and byte-fallback ids drawn often."""
    tok = tokenizer(family)
    n = tok.get_vocab_size(with_added_tokens=True)
    pools = [st.integers(0, n - 1), st.sampled_from(special_ids(tok))]
    if byte_ids(tok):
        pools.append(st.sampled_from(byte_ids(tok)))
    return draw(st.lists(st.one_of(pools), max_size=max_size))


@st.composite
def text_ids(draw: st.DrawFn, family: str) -> list[int]:
    tok = tokenizer(family)
    return tok.encode(draw(texts), add_special_tokens=False).ids


@st.composite
def byte_soup(draw: st.DrawFn, family: str) -> list[int]:
    """Long runs of one-byte tokens (continuation bytes drawn often), with a few other tokens: runs that
    stay incomplete, turn invalid, or complete late; longer than the detokenizer's settle distance."""
    tok = tokenizer(family)
    singles = single_byte_ids(tok)
    continuation = singles[0x80:0xC0]
    pools = [
        st.sampled_from(singles),
        st.sampled_from(continuation),
        st.sampled_from(special_ids(tok)),
        st.integers(0, tok.get_vocab_size(with_added_tokens=True) - 1),
    ]
    weights = st.sampled_from([0, 1, 1, 1, 1, 1, 0, 1, 2, 3])
    return [draw(pools[draw(weights)]) for _ in range(draw(st.integers(0, 60)))]


@st.composite
def case(draw: st.DrawFn) -> tuple[str, list[int], list[int], bool]:
    family = draw(families)
    tok = tokenizer(family)
    prompt_text = draw(st.sampled_from(["", "Hi", "Translate: ", "你好", "<s>", "a  "]))
    prompt = tok.encode(prompt_text, add_special_tokens=draw(st.booleans())).ids
    gen = draw(
        st.one_of(
            random_ids(family),
            text_ids(family),
            byte_soup(family),
            st.tuples(text_ids(family), random_ids(family, 6)).map(lambda t: t[0] + t[1]),
        )
    )
    return family, prompt, gen, draw(st.booleans())


@FUZZ
@given(case(), steps)
def test_stream_equals_reference(c: tuple[str, list[int], list[int], bool], split: list[int]) -> None:
    family, prompt, gen, skip = c
    tok = tokenizer(family)
    ref = reference_text(tok, prompt, gen, skip)
    assume(ref is not None)
    streamed = run_stream(tok, prompt, gen, split, skip=skip)
    whole = run_stream(tok, prompt, gen, [], skip=skip)
    assert "".join(streamed.deltas) == streamed.text == whole.text == ref
    assert streamed.num_tokens == len(gen)
    emitted = ""
    for delta in streamed.deltas:
        emitted += delta
        # Every delta extends a prefix of the final text: no U+FFFD or partial text later revised.
        assert ref.startswith(emitted)
        delta.encode("utf-8")  # no lone surrogates


@st.composite
def stop_case(draw: st.DrawFn) -> tuple[str, list[int], list[int], list[str], bool, int, bool]:
    family = draw(families)
    tok = tokenizer(family)
    prompt = tok.encode(draw(st.sampled_from(["", "Q: ", "日本"])), add_special_tokens=True).ids
    gen = draw(
        st.one_of(
            text_ids(family),
            st.tuples(text_ids(family), random_ids(family, 4)).map(lambda t: t[0] + t[1]),
            byte_soup(family),
        )
    )
    skip = draw(st.booleans())
    text = tok.decode(prompt + gen, skip_special_tokens=skip)
    stops: list[str] = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.integers(0, 3))
        if kind == 0 and text:  # a substring of the output: straddles tokens, multi-byte
            a = draw(st.integers(0, len(text) - 1))
            stops.append(text[a : a + draw(st.integers(1, 8))])
        elif kind == 1 and stops:  # a prefix or an extension of another stop
            other = draw(st.sampled_from(stops))
            stops.append(other[: draw(st.integers(1, len(other)))] if draw(st.booleans()) else other + draw(texts)[:3])
        else:
            stops.append(draw(st.text(st.sampled_from("ab 你👍\n\u0301e"), min_size=1, max_size=4)))
    return family, prompt, gen, stops, draw(st.booleans()), draw(st.integers(0, 6)), skip


@FUZZ
@given(stop_case(), steps)
def test_stop_strings(c: tuple[str, list[int], list[int], list[str], bool, int, bool], split: list[int]) -> None:
    family, prompt, gen, stops, include, min_tokens, skip = c
    tok = tokenizer(family)
    expected = expected_output(tok, prompt, gen, skip, stops, include, min_tokens)
    assume(expected is not None)
    assert expected is not None
    text, reason = expected
    got = run_stream(tok, prompt, gen, split, skip=skip, stops=stops, include=include, min_tokens=min_tokens)
    assert (got.text, got.stop_reason) == (text, reason)
    assert "".join(got.deltas) == got.text
    # Held-back text: at each step the client has all committed text but the last longest-1 chars.
    hold = max(len(s) for s in stops) - 1
    ends: list[int] = []
    for k, emitted in enumerate(got.emitted_after_step):
        ends.append((ends[-1] if ends else 0) + split[k % len(split)])
        if ends[-1] >= len(gen):
            break
        committed = stable_prefix_len(tok, prompt, gen[: ends[-1]], skip, ends)
        assert emitted >= min(committed, len(text)) - hold


@FUZZ
@given(case(), steps)
def test_chunking_never_changes_stop_result(c: tuple[str, list[int], list[int], bool], split: list[int]) -> None:
    family, prompt, gen, skip = c
    tok = tokenizer(family)
    text = reference_text(tok, prompt, gen, skip)
    assume(text)
    assert text is not None
    stops = [text[len(text) // 2 : len(text) // 2 + 3], text[-2:]]
    a = run_stream(tok, prompt, gen, split, skip=skip, stops=stops, min_tokens=len(gen) // 3)
    b = run_stream(tok, prompt, gen, [1], skip=skip, stops=stops, min_tokens=len(gen) // 3)
    assert (a.text, a.stop_reason) == (b.text, b.stop_reason)


@FUZZ
@given(
    families,
    st.lists(
        st.one_of(st.integers(-(2**70), -1), st.integers(0, 200_000), st.integers(2**31, 2**70)), min_size=1, max_size=8
    ),
    st.booleans(),
)
def test_bad_ids_raise_detokenize_error_only(family: str, ids: list[int], in_prompt: bool) -> None:
    tok = tokenizer(family)
    n = tok.get_vocab_size(with_added_tokens=True)
    bad = any(not 0 <= i < n for i in ids)
    try:
        d = IncrementalDetokenizer(tok, ids if in_prompt else [], stop=["x"])
        d.update([] if in_prompt else ids, True)
    except DetokenizeError as exc:
        assert bad, exc
        assert "vocabulary" in str(exc)
    else:
        assert not bad


@pytest.mark.parametrize("family", FUZZ_FAMILIES)
def test_reference_prefix_covers_min_tokens(family: str) -> None:
    """The support code's stable prefix agrees with the reference on plain ASCII (sanity of the oracle)."""
    tok = tokenizer(family)
    gen = tok.encode(" one two three", add_special_tokens=False).ids
    assert stable_prefix_len(tok, [], gen, True) == len(reference_text(tok, [], gen, True) or "")
