"""The fewest tokens any answer of a JSON schema can take: a lower bound from the names of its required members.

A schema can need more tokens than max_tokens allows (a GitHub webhook's pull request: 1,894 tokens at the least,
asked with max_tokens 384); no finish can then close the answer, and it would be cut invalid. The server refuses
such a request up front where this bound proves it (server/structured/answer_budget.py).

Why it is a lower bound. Written compactly (the grammar allows no free whitespace), every required member's name
K appears in the answer as `"K":`, once per required object, each occurrence at its own bytes. The tokens that
hold some byte of K are at least `cover(K)`: the fewest tokens of the vocabulary that, end to end, span K's
bytes, the first one maybe starting before K and the last maybe ending after it. No token holds bytes of two
names, as long as no token holds a name's last byte, `":`, and later a `"` with a byte after it (what lies
between two names); `Vocabulary.sound` checks that once (true of Qwen2's and Llama's vocabularies), and without it
the bound is 0. Values add nothing (`":"","` is one token: an empty string costs no token of its own), and
whatever the grammar may leave out (optional members, a branch of anyOf, an unresolved `$ref`) counts 0, so the
bound only ever undercounts.
"""

from __future__ import annotations

import bisect
import urllib.parse
from collections.abc import Iterable
from typing import Any

from engine.structured.json_pointer import MISSING, walk

MAX_DEPTH = 64  # nested schemas followed ($refs included); deeper ones count 0
_DATA = ("enum", "const", "default", "examples")  # keywords whose values are instances, not schemas


class Vocabulary:
    """A tokenizer's tokens as bytes, indexed for `cover`."""

    def __init__(self, tokens: Iterable[bytes]) -> None:
        found = {t for t in tokens if t}
        self._tokens = frozenset(found)
        self._starts = sorted(found)
        self._ends = sorted(t[::-1] for t in found)
        # the names some token holds with a quote on both sides (`"id"`): one token covers the whole name
        self._quoted = frozenset(part for t in found if t.count(b'"') >= 2 for part in t.split(b'"')[1:-1])
        self.sound = not any(_spans_two_names(t) for t in found)
        self._covers: dict[bytes, int] = {}

    def cover(self, name: bytes) -> int:
        """The fewest tokens that span `name`, the first and the last maybe reaching past it."""
        if name not in self._covers:
            self._covers[name] = self._cover(name)
        return self._covers[name]

    def _cover(self, name: bytes) -> int:
        n = len(name)
        if n == 0:
            return 0
        if name in self._quoted or _has_prefix(self._starts, name):  # one token holds it (and more)
            return 1
        best = [n + 1] * (n + 1)  # best[i]: tokens that span name[:i], the last ending at i
        for j in range(1, n + 1):  # the first token: ends with name[:j], maybe starting before the name
            if _has_prefix(self._ends, name[:j][::-1]):
                best[j] = 1
        for i in range(1, n):
            if best[i] > n:
                continue
            if _has_prefix(self._starts, name[i:]):  # the last token: from i to the end, maybe past it
                best[n] = min(best[n], best[i] + 1)
            for j in range(i + 1, n):
                if name[i:j] in self._tokens:
                    best[j] = min(best[j], best[i] + 1)
        return best[n] if best[n] <= n else 0  # no way to write it at all: claim nothing


def _has_prefix(ordered: list[bytes], prefix: bytes) -> bool:
    i = bisect.bisect_left(ordered, prefix)
    return i < len(ordered) and ordered[i].startswith(prefix)


def _spans_two_names(token: bytes) -> bool:
    """A byte, `":`, then a `"` with a byte after it: a token that could hold the end of one member's name and the
    start of the next's."""
    p = token.find(b'":', 1)
    while p != -1:
        if b'"' in token[p + 2 : -1]:
            return True
        p = token.find(b'":', p + 1)
    return False


def min_answer_tokens(schema: Any, vocab: Vocabulary) -> int:
    """A lower bound on the tokens of any compact JSON text the schema admits (0 where nothing is known)."""
    if not vocab.sound or not isinstance(schema, dict):
        return 0
    return _Walk(schema, vocab).floor(schema, None, {}, 0)


class _Walk:
    def __init__(self, root: dict[str, Any], vocab: Vocabulary) -> None:
        self.root = root
        self.vocab = vocab
        # a `$ref` is read against the root only when no subschema sets its own base
        self.plain_refs = not _nested_ids(root, top=True)

    def floor(self, s: Any, types: frozenset[str] | None, props: dict[str, Any], depth: int) -> int:
        """Tokens every instance of `s` takes, given the types (None: any) and properties an enclosing schema
        already imposes on it."""
        if not isinstance(s, dict) or depth > MAX_DEPTH:
            return 0
        if "$ref" in s:  # siblings of a $ref are ignored before draft 2019-09: only the target counts
            target = self._resolve(s["$ref"])
            return 0 if target is None else self.floor(target, types, props, depth + 1)
        if any(k in s for k in ("$dynamicRef", "$recursiveRef")):
            return 0
        types = _meet(types, s.get("type"))
        own = s.get("properties")
        props = {**props, **own} if isinstance(own, dict) else props
        parts = [self._shape(s, types, props, depth)]
        for key in ("anyOf", "oneOf"):
            branches = s.get(key)
            if isinstance(branches, list) and branches:
                parts.append(min(self.floor(b, types, props, depth + 1) for b in branches))
        for member in s.get("allOf", []) if isinstance(s.get("allOf"), list) else []:
            parts.append(self.floor(member, types, props, depth + 1))
        return max(parts)

    def _shape(self, s: dict[str, Any], types: frozenset[str] | None, props: dict[str, Any], depth: int) -> int:
        """The object's required members, or the array's first minItems items, when no other type is allowed."""
        if types == frozenset({"object"}) and isinstance(s.get("required"), list):
            total = 0
            for key in dict.fromkeys(k for k in s["required"] if isinstance(k, str)):
                total += self.vocab.cover(_plain_name(key)) + self.floor(props.get(key), None, {}, depth + 1)
            return total
        if types == frozenset({"array"}) and isinstance(s.get("items"), dict) and "prefixItems" not in s:
            least = s.get("minItems", 0)
            if isinstance(least, int) and least > 0:
                return least * self.floor(s["items"], None, {}, depth + 1)
        return 0

    def _resolve(self, ref: Any) -> Any:
        """A `#/...` pointer into the root; None for anything else (another document, an anchor)."""
        if not self.plain_refs or not isinstance(ref, str) or not ref.startswith("#"):
            return None
        node = walk(self.root, filter(None, urllib.parse.unquote(ref[1:]).split("/")))
        return None if node is MISSING else node


def _plain_name(key: str) -> bytes:
    """The name's bytes as the grammar writes them; b"" (counts 0) for one with characters JSON may escape."""
    return key.encode() if all(" " <= c <= "~" and c not in '"\\' for c in key) else b""


def _meet(types: frozenset[str] | None, declared: Any) -> frozenset[str] | None:
    """The types both allow (None: any); "integer" is a "number" but neither is an object or an array."""
    if isinstance(declared, str):
        declared = [declared]
    if not isinstance(declared, list) or not all(isinstance(t, str) for t in declared):
        return types
    mine = frozenset(declared)
    return mine if types is None else types & mine


def _nested_ids(node: Any, top: bool = False) -> bool:
    """Some subschema sets its own base URI (`$id`, draft 4's `id`): its `#/...` refs are not the root's."""
    if isinstance(node, dict):
        if not top and isinstance(node.get("$id") or node.get("id"), str):
            return True
        return any(_nested_ids(v) for k, v in node.items() if k not in _DATA)
    if isinstance(node, list):
        return any(_nested_ids(v) for v in node)
    return False
