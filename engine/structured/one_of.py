"""oneOf as an anyOf llguidance can enforce, meaning the same or less (every value the anyOf allows meets the oneOf).

llguidance enforces oneOf only where its branches have different types; its lenient mode reads any other oneOf as
anyOf, so an answer may meet two branches and fail the oneOf. Here, for one oneOf's branches:
- exact: every two exclude each other. A branch is read as the conjunction of its keywords, its local $ref's target
  (alone in drafts 3 to 7, which ignore a $ref's siblings) and its allOf members; two exclude each other when their
  types, their const / enum values, a property both require (its subschemas, again), or a property one requires and
  the other forbids (`properties: {k: false}`, `additionalProperties: false` without k, `not: {required: [k]}`)
  have no value in common, or they hold strings only whose patterns no string matches both (llguidance's regex
  intersection, the check it makes of patternProperties).
- narrowed (fewer values, each valid): a branch that overlaps another gets, against each, one of the other's
  required properties forbidden (`properties: {k: false}`), else one of its own properties the other forbids
  required: it then meets no value of the other, where one of the two holds objects only; a branch that cannot be
  told from another that way is dropped (`false`). Strings against a branch of a known format: a pattern no string
  of that format matches (FORMAT_SHAPES: `hostname` against `ipv4` gets a character other than digits and dots).
  When every branch would go, nothing is rewritten (the oneOf stays relaxed).

No torch.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import llguidance

from engine.structured.grammar import LIMITS
from engine.structured.json_pointer import MISSING, walk

MAX_BRANCHES = 32  # branches compared pairwise
MAX_DEPTH = 6  # $ref / allOf / property levels followed
_DRAFTS_IGNORING_REF_SIBLINGS = tuple(f"json-schema.org/draft-0{n}/" for n in (3, 4, 6, 7))
# format: (a regex every valid string matches, one no valid string matches), as jsonschema's checkers read them
# (ipaddress, uuid.UUID, a date): ipv4 is digits and dots, ipv6 has a colon, an email an @
FORMAT_SHAPES = {
    "ipv4": ("^[0-9.]+$", "[^0-9.]"),
    "ipv6": (":", "^[^:]*$"),
    "email": ("@", "^[^@]*$"),
    "uuid": ("^[0-9a-fA-F-]+$", "[^0-9a-fA-F-]"),
}
_ALL = frozenset({"null", "boolean", "object", "array", "number", "integer", "string"})


@dataclass(slots=True)
class _Facts:
    """What a branch's conjuncts say about its values (None: no bound)."""

    types: frozenset[str] | None = None
    values: list[Any] | None = None
    required: set[str] = field(default_factory=set)
    forbidden: set[str] = field(default_factory=set)
    allowed: set[str] | None = None  # the only keys allowed (`additionalProperties: false`), None: any
    properties: dict[str, list[Any]] = field(default_factory=dict)
    patterns: list[str] = field(default_factory=list)
    outside: list[str] = field(default_factory=list)  # regexes no value of its formats matches
    excluded: list[Any] = field(default_factory=list)  # values a `not` rules out
    low: float | None = None  # numbers: the greatest lower bound given (exclusive or not)
    high: float | None = None  # and the least upper bound
    shortest: int = 0  # strings: minLength
    longest: int | None = None  # and maxLength
    never: bool = False  # no value (a `false` conjunct)

    def object_only(self) -> bool:
        return self.never or (self.types is not None and self.types <= {"object"})

    def string_only(self) -> bool:
        return self.types is not None and self.types <= {"string"}

    def forbids(self, key: str) -> bool:
        return key in self.forbidden or (self.allowed is not None and key not in self.allowed)


_CONTEXT = ("type", "required", "properties", "additionalProperties", "patternProperties", "minimum", "maximum")


def branch_facts(node: dict[str, Any], root: Any) -> list[_Facts]:
    """What each oneOf branch says, with what the node itself says of every value (its type, required keys, ...)."""
    context = {k: node[k] for k in _CONTEXT if k in node}
    return [_facts({**context, "allOf": [b]} if context else b, root, 0) for b in node["oneOf"]]


def exclusive(branches: list[Any], node: dict[str, Any], root: Any) -> bool:
    """No value meets two of these oneOf branches (of `node`, in the document `root`)."""
    return len(branches) < 2 or all_disjoint(branch_facts({**node, "oneOf": branches}, root), root)


def all_disjoint(facts: list[_Facts], root: Any) -> bool:
    return all(disjoint(a, b, root) for i, a in enumerate(facts) for b in facts[i + 1 :])


def narrow(node: dict[str, Any], root: Any, negate: Callable[[Any], Any] = lambda _: None) -> bool:
    """Rewrite node's oneOf into an anyOf that means the same (its branches exclude each other) or less (narrowed);
    False when left as it is."""
    branches = node.get("oneOf")
    if not isinstance(branches, list) or not branches or len(branches) > MAX_BRANCHES or "anyOf" in node:
        return False
    facts = branch_facts(node, root)
    if all_disjoint(facts, root):
        node["anyOf"] = node.pop("oneOf")
        return True
    narrowed = [_narrow(i, branches, facts, root, negate) for i in range(len(branches))]
    if all(b is False for b in narrowed):
        return False
    node["anyOf"] = narrowed
    del node["oneOf"]
    return True


def _narrow(i: int, branches: list[Any], facts: list[_Facts], root: Any, negate: Callable[[Any], Any]) -> Any:
    """Branch i told apart from each branch it may share a value with: a pattern no string of that branch's format
    matches, else one of that branch's required properties forbidden, else one of its own properties that branch
    forbids required; False when none is there."""
    forbid: list[str] = []
    require: list[str] = []
    apart: list[str] = []
    written: list[Any] = []
    objects = False
    mine = facts[i]
    for j, other in enumerate(facts):
        if j == i or disjoint(mine, other, root):
            continue
        if (mine.string_only() or other.string_only()) and other.outside:
            apart.append(other.outside[0])  # a string of other's format never matches it
            continue
        negation = negate(branches[j])
        if negation is not None:  # exact: mine and not other
            written.append(negation)
            continue
        if not (mine.object_only() or other.object_only()):
            if mine.types is not None and "object" not in mine.types:
                return False
            objects = True  # narrowed to objects too: a value that is none meets every `required`
        absent = sorted(other.required - mine.required)
        present = sorted(k for k in mine.properties if other.forbids(k) and not mine.forbids(k))
        present += sorted(k for k in set(mine.properties) & set(other.properties) if _apart(mine, other, k, root))
        if absent:
            forbid.append(absent[0])
        elif present:
            require.append(present[0])
        else:
            return False
    if not forbid and not require and not apart and not written:
        return branches[i]
    told: list[Any] = [{"type": "object"}] if objects else []
    told += [{"properties": {k: False for k in forbid}}] if forbid else []
    told += [{"required": sorted(set(require))}] if require else []
    told += [{"pattern": p} for p in dict.fromkeys(apart)] + written
    return {"allOf": [branches[i], *told]}


def _apart(a: _Facts, b: _Facts, key: str, root: Any) -> bool:
    """No value of `key` meets both branches' schemas of it (present in both, a discriminator not required)."""
    return any(
        disjoint(_facts(x, root, 1), _facts(y, root, 1), root, 1) for x in a.properties[key] for y in b.properties[key]
    )


def disjoint(a: _Facts, b: _Facts, root: Any, depth: int = 0) -> bool:
    """No value meets both."""
    if a.never or b.never:
        return True
    if a.types is not None and b.types is not None and not _overlap(a.types, b.types):
        return True
    if a.values is not None and b.values is not None and not any(_same_value(v, w) for v in a.values for w in b.values):
        return True
    for x, y in ((a, b), (b, a)):
        if any(y.forbids(k) for k in x.required) and (x.object_only() or y.object_only()):
            return True
        if x.values is not None and y.types is not None and not any(_json_type(v) & y.types for v in x.values):
            return True
        if x.values is not None and all(any(_same_value(v, e) for e in y.excluded) for v in x.values):
            return True
        if _number_only(x) and _number_only(y) and x.low is not None and y.high is not None and y.high < x.low:
            return True
        if (x.string_only() or y.string_only()) and y.longest is not None and y.longest < x.shortest:
            return True
    if (a.string_only() or b.string_only()) and any(patterns_disjoint(p, q) for p in a.patterns for q in b.patterns):
        return True
    if depth >= MAX_DEPTH:
        return False
    for key in (a.required & b.required) & (set(a.properties) & set(b.properties)):
        pa = [_facts(s, root, depth + 1) for s in a.properties[key]]
        pb = [_facts(s, root, depth + 1) for s in b.properties[key]]
        if any(disjoint(x, y, root, depth + 1) for x in pa for y in pb):
            return True
    return False


@functools.lru_cache(maxsize=256)
def patterns_disjoint(p: str, q: str) -> bool:
    """No string matches both regexes (llguidance refuses patternProperties that overlap, and proves the rest)."""
    schema = {"type": "object", "patternProperties": {p: {}, q: {}}}
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        failed, _ = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, limits=LIMITS)
    except Exception:  # a regex it cannot read: nothing proved
        return False
    return p != q and not failed


def _number_only(f: _Facts) -> bool:
    return f.types is not None and f.types <= {"number", "integer"}


def _json_type(value: Any) -> set[str]:
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return {"integer", "number"}
    kinds = {float: "number", str: "string", list: "array", dict: "object", type(None): "null"}
    return {kinds.get(type(value), "other")}


def _overlap(a: frozenset[str], b: frozenset[str]) -> bool:
    return bool(a & b) or ("number" in a and "integer" in b) or ("integer" in a and "number" in b)


def _same_value(v: Any, w: Any) -> bool:
    """JSON equality at the top: Python's == takes true for 1, JSON Schema does not (1 and 1.0 are one value)."""
    return bool(v == w) and isinstance(v, bool) == isinstance(w, bool)


def _facts(schema: Any, root: Any, depth: int) -> _Facts:
    facts = _Facts()
    for part in _conjuncts(schema, root, depth):
        _add(facts, part)
    return facts


def _conjuncts(schema: Any, root: Any, depth: int) -> list[Any]:
    """The schemas `schema` is the conjunction of: itself (less $ref and allOf), its $ref's target, its allOf's."""
    if not isinstance(schema, dict) or depth > MAX_DEPTH:
        return [schema] if schema is False else []
    ref = schema.get("$ref")
    target = _resolve(root, ref) if isinstance(ref, str) else None
    if isinstance(ref, str) and _ref_siblings_ignored(root):
        return _conjuncts(target, root, depth + 1) if target is not None else []
    parts: list[Any] = [{k: v for k, v in schema.items() if k not in ("$ref", "allOf")}]
    if target is not None:
        parts += _conjuncts(target, root, depth + 1)
    members = schema.get("allOf")
    for member in members if isinstance(members, list) else ():
        parts += _conjuncts(member, root, depth + 1)
    return parts


def _add(facts: _Facts, part: Any) -> None:
    if part is False:
        facts.never = True
        return
    kind = part.get("type")
    types = {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else None
    if types is not None:
        types |= {"integer"} if "number" in types else set()
        facts.types = frozenset(types & _ALL) if facts.types is None else facts.types & types
    values = [part["const"]] if "const" in part else part.get("enum")
    if isinstance(values, list):
        facts.values = values if facts.values is None else [v for v in facts.values if v in values]
    for key in ("minimum", "exclusiveMinimum"):
        bound = part.get(key)
        if isinstance(bound, (int, float)) and not isinstance(bound, bool):
            facts.low = bound if facts.low is None else max(facts.low, bound)
    for key in ("maximum", "exclusiveMaximum"):
        bound = part.get(key)
        if isinstance(bound, (int, float)) and not isinstance(bound, bool):
            facts.high = bound if facts.high is None else min(facts.high, bound)
    shortest, longest = part.get("minLength"), part.get("maxLength")
    if isinstance(shortest, int) and not isinstance(shortest, bool):
        facts.shortest = max(facts.shortest, shortest)
    if isinstance(longest, int) and not isinstance(longest, bool):
        facts.longest = longest if facts.longest is None else min(facts.longest, longest)
    pattern, shape = part.get("pattern"), FORMAT_SHAPES.get(str(part.get("format")))
    facts.patterns += [pattern] if isinstance(pattern, str) else []
    facts.patterns += [shape[0]] if shape else []
    facts.outside += [shape[1]] if shape else []
    required, props = part.get("required"), part.get("properties")
    facts.required |= {k for k in required if isinstance(k, str)} if isinstance(required, list) else set()
    props = props if isinstance(props, dict) else {}
    for key, sub in props.items():
        facts.properties.setdefault(key, []).append(sub)
    facts.forbidden |= {k for k, sub in props.items() if sub is False}
    if part.get("additionalProperties") is False and not part.get("patternProperties"):
        facts.allowed = set(props) if facts.allowed is None else facts.allowed & set(props)
    negated = part.get("not")
    values = _values_of(negated) if isinstance(negated, dict) else None
    facts.excluded += values or []
    if isinstance(negated, dict) and set(negated) == {"required"} and isinstance(negated["required"], list):
        if len(negated["required"]) == 1 and isinstance(negated["required"][0], str):
            facts.forbidden.add(negated["required"][0])


def _values_of(schema: dict[str, Any]) -> list[Any] | None:
    """The values of a `const` / `enum` (beside only a `type` and annotations), else None."""
    if not set(schema) - {"type", "title", "description"} <= {"const", "enum"}:
        return None
    values = [schema["const"]] if "const" in schema else schema.get("enum")
    return values if isinstance(values, list) else None


def _resolve(root: Any, ref: str) -> Any:
    """The local `#/...` pointer's target, or None."""
    if not ref.startswith("#/"):
        return root if ref == "#" else None
    node = walk(root, ref[2:].split("/"))
    return None if node is MISSING else node


def _ref_siblings_ignored(root: Any) -> bool:
    dialect = root.get("$schema") if isinstance(root, dict) else None
    return isinstance(dialect, str) and any(d in dialect for d in _DRAFTS_IGNORING_REF_SIBLINGS)


def first_one_of(schema: Any) -> str | None:
    """The JSON pointer of the first oneOf in `schema` (breadth first) whose branches may overlap, or None."""
    queue: list[tuple[Any, str]] = [(schema, "")]
    while queue:
        node, path = queue.pop(0)
        if isinstance(node, dict):
            branches = node.get("oneOf")
            if isinstance(branches, list) and not exclusive(branches, node, schema):
                return path or "/"
            queue += [(v, f"{path}/{str(k).replace('~', '~0').replace('/', '~1')}") for k, v in node.items()]
        elif isinstance(node, list):
            queue += [(v, f"{path}/{i}") for i, v in enumerate(node)]
    return None
