"""Short strings that match a schema's `pattern`s: ways out of a string for the finish search.

The finish search (engine/structured/finish_search.py) sees only the next-token mask, and inside a string whose
regex needs a particular text (`\\.png$`, `http://schema.org`, `^.+/.+\\.ya?ml$`) every character leaves the
mask as it was until that text is complete, so the search cannot tell which way is out. A short match of each
pattern, computed here from the schema, is tried there instead (its suffixes too: the string may be begun).

Python's regex parser reads the pattern (ECMA patterns are nearly all its syntax too); one it cannot read, or
that needs look-around or back-references, gives no sample. No torch, no llguidance.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from re import _constants as _c  # type: ignore[attr-defined]  # Python's own regex parser (3.11+)
from re import _parser as _p  # type: ignore[attr-defined]
from typing import Any

MAX_SAMPLES = 256  # patterns sampled per schema (each sample costs the search a validation when stuck)
MAX_LENGTH = 64  # characters: a longer sample is no short way out
MAX_PADDED = 256  # characters a sample is padded to for a string's minLength
_PREFERRED = "a1A0_-."  # characters a class is sampled with first (plain, one token each, no JSON escape)


class _NoSample(Exception):
    pass


def pattern_sample(pattern: str) -> str | None:
    """A short string the regex `pattern` finds (search semantics, as JSON Schema's), or None."""
    try:
        parsed = _p.parse(pattern)
        text = _shortest(list(parsed))
    except (_NoSample, re.error, RecursionError, ValueError, TypeError, OverflowError):
        return None
    if len(text) > MAX_LENGTH or re.search(pattern, text) is None:
        return None
    return text


def schema_samples(schema: Any) -> list[str]:
    """Samples of the schema's string patterns (pattern and patternProperties' values' patterns), JSON-escaped
    as they appear inside a string, without repeats; at most MAX_SAMPLES."""
    found: dict[str, None] = {}
    for node in _objects(schema, found):
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            sample = pattern_sample(pattern)
            if sample:
                found[json.dumps(sample)[1:-1]] = None
                longer = _padded(pattern, sample, node.get("minLength"), node.get("maxLength"))
                if longer:  # the sample alone cannot end a string of that minLength: no way out there
                    found[json.dumps(longer)[1:-1]] = None
    return list(found)


def _padded(pattern: str, sample: str, low: Any, high: Any) -> str | None:
    """`sample` made `low` characters long (filler before or after it) where the pattern still finds it and
    `high` allows it; None where it is long enough already or no filler keeps the match."""
    if not isinstance(low, int) or low <= len(sample) or low > MAX_PADDED:
        return None
    fill = low - len(sample)
    for text in (f"{'a' * fill}{sample}", f"{sample}{'a' * fill}", f"{'0' * fill}{sample}", f"{sample}{'0' * fill}"):
        if (not isinstance(high, int) or len(text) <= high) and re.search(pattern, text) is not None:
            return text
    return None


def required_keys(schema: Any) -> list[str]:
    """The names in the schema's `required` lists, JSON-escaped, without repeats; at most MAX_SAMPLES."""
    found: dict[str, None] = {}
    for node in _objects(schema, found):
        required = node.get("required")
        if isinstance(required, list):
            found.update((json.dumps(k)[1:-1], None) for k in required if isinstance(k, str))
    return list(found)[:MAX_SAMPLES]


def _objects(schema: Any, found: dict[str, None]) -> Iterator[dict[str, Any]]:
    """Every object in the schema, depth first, until `found` holds MAX_SAMPLES (the walk is bounded by it)."""
    stack = [schema]
    while stack and len(found) < MAX_SAMPLES:
        node = stack.pop()
        if isinstance(node, dict):
            yield node
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def _shortest(items: list[tuple[Any, Any]]) -> str:
    return "".join(_item(op, av) for op, av in items)


def _or_none(items: list[tuple[Any, Any]]) -> str | None:
    try:
        return _shortest(items)
    except _NoSample:
        return None


def _item(op: Any, av: Any) -> str:
    if op is _c.LITERAL:
        return chr(av)
    if op in (_c.AT,):
        return ""
    if op is _c.SUBPATTERN:
        return _shortest(list(av[-1]))
    if op is _c.BRANCH:
        found = [text for b in av[1] if (text := _or_none(list(b))) is not None]
        if not found:
            raise _NoSample("branch")
        return min(found, key=len)
    if op in (_c.MAX_REPEAT, _c.MIN_REPEAT, getattr(_c, "POSSESSIVE_REPEAT", None)):
        low, _high, body = av
        return _shortest(list(body)) * int(low) if low else ""  # none of it: its body need not be writable
    if op is _c.ANY:
        return "a"
    if op is _c.NOT_LITERAL:
        return next(ch for ch in _PREFERRED if ord(ch) != av)
    if op is _c.IN:
        return _in_class(av)
    if op is getattr(_c, "ATOMIC_GROUP", None):
        return _shortest(list(av))
    raise _NoSample(str(op))  # look-around, back-references, conditionals


def _in_class(items: list[tuple[Any, Any]]) -> str:
    """A character of a [...] class: a preferred one when it is in the class, else the class's first."""
    negate = bool(items) and items[0][0] is _c.NEGATE
    body = items[1:] if negate else items

    def member(ch: str) -> bool:
        code = ord(ch)
        for op, av in body:
            if (op is _c.LITERAL and av == code) or (op is _c.RANGE and av[0] <= code <= av[1]):
                return True
            if op is _c.CATEGORY and re.fullmatch(_category_regex(av), ch):
                return True
        return False

    for ch in _PREFERRED + "".join(chr(c) for c in range(0x21, 0x7F)) + " ":
        if ch not in '"\\' and member(ch) != negate:
            return ch
    raise _NoSample("class")


def _category_regex(category: Any) -> str:
    regexes = {
        _c.CATEGORY_DIGIT: r"\d",
        _c.CATEGORY_NOT_DIGIT: r"\D",
        _c.CATEGORY_SPACE: r"\s",
        _c.CATEGORY_NOT_SPACE: r"\S",
        _c.CATEGORY_WORD: r"\w",
        _c.CATEGORY_NOT_WORD: r"\W",
    }
    return regexes.get(category, r"(?!)")
