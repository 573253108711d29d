"""Reference model of the detokenizer's contract, shared by the hypothesis properties and atheris.

Everything here is computed from `tokenizer.decode` on whole sequences, independently of
server/request/detokenizer.py's incremental algorithm.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass, field

import tokenizers

from demo.tokenizers import load_tokenizer
from server.request.detokenizer import SETTLE_TOKENS, IncrementalDetokenizer

FUZZ_FAMILIES = ("qwen2", "llama", "tekken")

# Real text mixing scripts: ASCII, CJK, emoji (ZWJ, skin tones, flags), combining marks, RTL, whitespace runs.
FRAGMENTS = [
    "Hello",
    " world",
    "the",
    " quick",
    "brown fox",
    ",",
    ".",
    "!",
    "?",
    "'s",
    " don't",
    "123",
    " 4.56",
    "你好",
    "世界",
    "中文测试",
    "日本語",
    "テスト",
    "한국어",
    "𠜎𠝹",  # CJK incl. astral plane
    "👍",
    "👍🏽",
    "👨\u200d👩\u200d👧\u200d👦",
    "🏳️\u200d🌈",
    "🇫🇷",
    "🇯🇵",
    "😀",
    "🫠",
    "e\u0301",
    "n\u0303",
    "a\u0308\u0304",
    "ﬁ",
    "Ω",
    "ß",
    "İ",  # combining marks, ligatures, case quirks
    "שלום",
    " עולם",
    "مرحبا",
    " بالعالم",
    "\u200f",
    "\u202e",  # RTL and direction marks
    " ",
    "  ",
    "    ",
    "\t",
    "\n",
    "\n\n",
    "\r\n",
    " \n ",
    "\u00a0",
    "\u3000",
    "<",
    ">",
    "</",
    "STOP",
    "stop",
    "END",
    "###",
    "\\",
    '"',
    "{",
    "}",
    "\x00",
    "\ufffd",
]


@dataclass
class StreamResult:
    deltas: list[str] = field(default_factory=list)
    emitted_after_step: list[int] = field(default_factory=list)  # len of all deltas after each step
    text: str = ""
    stop_reason: str | None = None
    num_tokens: int = 0


def reference_text(tok: tokenizers.Tokenizer, prompt: list[int], gen: list[int], skip: bool) -> str | None:
    """decode(prompt + gen) minus decode(prompt); None when the prompt's text is not a prefix
    (a prompt ending inside a character or a byte-fallback run: no sensible reference)."""
    head = tok.decode(prompt, skip_special_tokens=skip)
    full = tok.decode(prompt + gen, skip_special_tokens=skip)
    if not full.startswith(head):
        return None
    return full[len(head) :]


def special_ids(tok: tokenizers.Tokenizer) -> list[int]:
    return sorted(i for i, t in tok.get_added_tokens_decoder().items() if t.special)


def byte_ids(tok: tokenizers.Tokenizer) -> list[int]:
    found = (tok.token_to_id(f"<0x{b:02X}>") for b in range(256))
    return [i for i in found if i is not None]


def single_byte_ids(tok: tokenizers.Tokenizer) -> list[int]:
    """Ids of tokens that are one byte each: byte-fallback tokens, or byte-level BPE's 256 base tokens."""
    if found := byte_ids(tok):
        return found
    # GPT-2's byte -> char table: printable Latin-1 bytes stand for themselves, the rest map to U+0100...
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    chars.update({b: chr(0x100 + k) for k, b in enumerate(b for b in range(256) if b not in chars)})
    return [i for b in range(256) if (i := tok.token_to_id(chars[b])) is not None]


def _run_is_invalid(tok: tokenizers.Tokenizer, visible: list[int]) -> bool:
    """The trailing byte-fallback run of `visible` is not valid UTF-8 (not merely incomplete)."""
    values = {i: int((tok.id_to_token(i) or "")[3:5], 16) for i in byte_ids(tok)}
    run = bytearray()
    for i in reversed(visible):
        if i not in values:
            break
        run.append(values[i])
    try:
        codecs.getincrementaldecoder("utf-8")().decode(bytes(reversed(run)), final=False)
    except UnicodeDecodeError:
        return True
    return False


def stable_prefix_len(
    tok: tokenizers.Tokenizer, prompt: list[int], gen: list[int], skip: bool, ends: Sequence[int] | None = None
) -> int:
    """Length of the reference text that is final once `gen` is consumed in steps ending at `ends`
    (default: token by token): up to the last step end after a visible token that
    - is not a byte-fallback token and does not leave the text ending in U+FFFD, or
    - ends a byte-fallback run that is not valid UTF-8 (it decodes to one U+FFFD per byte whatever follows), or
    - is not a byte-fallback token, leaves the text ending in U+FFFD, and is followed by at least
      SETTLE_TOKENS visible tokens of `gen` whose decode keeps that text (it can no longer change)."""
    hidden = set(special_ids(tok)) if skip else set()
    bytes_ = set(byte_ids(tok))
    head = tok.decode(prompt, skip_special_tokens=skip)
    everything = tok.decode(prompt + gen, skip_special_tokens=skip)
    candidates = (
        range(len(gen), 0, -1) if ends is None else sorted((e for e in ends if 0 < e <= len(gen)), reverse=True)
    )
    for j in candidates:
        last = gen[j - 1]
        if last in hidden:
            continue
        full = tok.decode(prompt + gen[:j], skip_special_tokens=skip)
        if last in bytes_:
            if _run_is_invalid(tok, [i for i in prompt + gen[:j] if i not in hidden]):
                return len(full) - len(head)
            continue
        if not full.endswith("\ufffd"):
            return len(full) - len(head)
        if sum(i not in hidden for i in gen[j:]) >= SETTLE_TOKENS and everything.startswith(full):
            return len(full) - len(head)
    return 0


def first_stop(text: str, start: int, stops: Sequence[str]) -> tuple[int, str] | None:
    """Earliest position >= start where a stop string begins; ties go to the stop listed first."""
    for y in range(start, len(text)):
        for s in stops:
            if s and text.startswith(s, y):
                return y, s
    return None


def expected_output(
    tok: tokenizers.Tokenizer,
    prompt: list[int],
    gen: list[int],
    skip: bool,
    stops: Sequence[str],
    include: bool,
    min_tokens: int,
) -> tuple[str, str | None] | None:
    text = reference_text(tok, prompt, gen, skip)
    if text is None:
        return None
    if min_tokens > len(gen):
        return text, None  # stop strings are not searched before min_tokens tokens exist
    start = stable_prefix_len(tok, prompt, gen[:min_tokens], skip) if min_tokens > 0 else 0
    hit = first_stop(text, start, stops)
    if hit is None:
        return text, None
    at, s = hit
    return text[: at + len(s) if include else at], s


def run_stream(
    tok: tokenizers.Tokenizer,
    prompt: list[int],
    gen: list[int],
    steps: Sequence[int],
    *,
    skip: bool = True,
    stops: Sequence[str] = (),
    include: bool = False,
    min_tokens: int = 0,
) -> StreamResult:
    """Feed `gen` in chunks of the given sizes (cycled), then finish."""
    d = IncrementalDetokenizer(
        tok, prompt, skip_special_tokens=skip, stop=stops, include_stop_str_in_output=include, min_tokens=min_tokens
    )
    out = StreamResult()
    emitted = 0
    pos = 0
    k = 0
    while True:
        size = steps[k % len(steps)] if steps else len(gen)
        k += 1
        chunk = gen[pos : pos + max(size, 1)]
        pos += len(chunk)
        last = pos >= len(gen)
        reason = d.update(chunk, last)
        delta = d.take_delta()
        out.deltas.append(delta)
        emitted += len(delta)
        out.emitted_after_step.append(emitted)
        if reason is not None or last:
            out.stop_reason = reason
            break
    out.text = d.output_text
    out.num_tokens = d.num_output_tokens
    assert d.take_delta() == ""
    return out


def tokenizer(family: str) -> tokenizers.Tokenizer:
    return load_tokenizer(family)  # type: ignore[arg-type]
