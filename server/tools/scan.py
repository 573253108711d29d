"""A tolerant, prefix-monotone scanner for the JSON the tool parsers read.

Prefix-monotone: what it reports about a prefix of a text (members found, values ended, an error) stays
true of every longer text that starts with it. The streaming parsers rely on that: text is never
retracted, so the calls streamed from any cut of the output equal the calls parsed from the whole.
It never raises: odd content is an error position or an unfinished value.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

_WS = " \t\n\r"
_SCALAR_END = ",}] \t\n\r"


def held(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (it may become the tag)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def skip_ws(s: str, i: int) -> int:
    n = len(s)
    while i < n and s[i] in _WS:
        i += 1
    return i


def string_end(s: str, i: int) -> int | None:
    """s[i] == '"': the index after the closing quote, or None when the text ends first."""
    i += 1
    n = len(s)
    while i < n:
        c = s[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return None


def value_end(s: str, i: int) -> int | None:
    """The index after the JSON value starting at s[i], or None when the text ends first (or it cannot be
    told yet: a number may go on). Brackets are matched by depth without checking what lies between."""
    n = len(s)
    if i >= n:
        return None
    c = s[i]
    if c == '"':
        return string_end(s, i)
    if c in "{[":
        depth = 0
        while i < n:
            c = s[i]
            if c == '"':
                end = string_end(s, i)
                if end is None:
                    return None
                i = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return None
    while i < n and s[i] not in _SCALAR_END:
        i += 1
    return i if i < n else None


@dataclass
class Member:
    key: str
    start: int  # where the value starts (== len(text) when only the key is known)
    end: int | None  # after the value; None: unfinished


@dataclass
class ObjectScan:
    members: list[Member]
    end: int | None  # after the closing brace; None: unfinished (or broken)
    error: bool  # not a JSON object: nothing after the members found can be trusted


def scan_object(s: str, i: int) -> ObjectScan:
    """The top-level members of the object at s[i] (s[i] == '{')."""
    members: list[Member] = []
    n = len(s)
    i += 1
    expect_key = True
    while True:
        i = skip_ws(s, i)
        if i >= n:
            return ObjectScan(members, None, False)
        c = s[i]
        if c == "}":
            return ObjectScan(members, i + 1, False)
        if c == ",":
            if expect_key:
                return ObjectScan(members, None, True)
            expect_key = True
            i += 1
            continue
        if c != '"' or not expect_key:
            return ObjectScan(members, None, True)
        key_end = string_end(s, i)
        if key_end is None:
            return ObjectScan(members, None, False)
        key = s[i + 1 : key_end - 1]
        i = skip_ws(s, key_end)
        if i >= n:
            return ObjectScan(members, None, False)
        if s[i] != ":":
            return ObjectScan(members, None, True)
        i = skip_ws(s, i + 1)
        end = value_end(s, i)
        members.append(Member(key, i, end))
        if end is None:
            return ObjectScan(members, None, False)
        i = end
        expect_key = False


def json_string(raw: str) -> str | None:
    """The value of a complete JSON string literal, or None."""
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, str) else None
