"""`unevaluatedProperties` (2019-09 / 2020-12) as `additionalProperties`, where that means exactly the same: llguidance
does not implement the first (its lenient mode drops it), and enforces the second.

A property is evaluated when `properties`, `patternProperties`, `additionalProperties` or `unevaluatedProperties`
of the node or of a subschema applied in place (allOf, $ref; anyOf, oneOf, if/then/else, dependentSchemas where
they pass) validated it. When a valid value always passes the unconditional parts (the node, its allOf members and
local $refs, recursively), their names and patterns are known without the value; so where every name and pattern
of a conditional part is one of those too, `unevaluatedProperties: S` is `additionalProperties: S` beside
`properties` / `patternProperties` widened (with `true`) to that union. Where an unconditional part has an
`additionalProperties` or `unevaluatedProperties` of its own, every key is already evaluated and the keyword goes.
Anything else (a conditional part naming other keys, $dynamicRef, a $ref out of the document, nested $id) is left
as it is (for lenient mode, which names it relaxed).

No torch, no llguidance.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.structured.json_pointer import MISSING, walk

_CONDITIONAL_ONE = ("if", "then", "else")
_CONDITIONAL_MANY = ("anyOf", "oneOf")
_OPEN = ("additionalProperties", "unevaluatedProperties")  # evaluate every key their node's others leave
_UNKNOWN = ("$dynamicRef", "$recursiveRef")  # targets known only at validation time


class _Unknown(Exception):
    """The evaluated keys depend on more than this module reads."""


@dataclass
class _Found:
    names: set[str] = field(default_factory=set)
    patterns: set[str] = field(default_factory=set)
    open: bool = False  # an unconditional additionalProperties / unevaluatedProperties: every key evaluated
    cond_names: set[str] = field(default_factory=set)
    cond_patterns: set[str] = field(default_factory=set)


def rewrite_unevaluated(
    root: dict[str, Any], nodes: list[dict[str, Any]], walk: Callable[[Any], list[dict[str, Any]]]
) -> bool:
    """Rewrite, in place, every node of `nodes` (the subschemas of `root`, as `walk` finds them) and of the local
    $refs' targets (`#/$defs/group/name`: a schema `walk` cannot tell from a folder of them) whose
    `unevaluatedProperties` can be written exactly as above; True when one was. All are read before any changes."""
    dialect = root.get("$schema")
    if isinstance(dialect, str) and "json-schema.org/draft-0" in dialect:
        return False  # drafts 3 to 7 have no unevaluatedProperties (it constrains nothing there)
    if any("$id" in n for n in nodes if n is not root):
        return False  # a "#/..." $ref under an embedded resource points into that resource, not the root
    nodes = _with_targets(root, nodes, walk)
    plans = []
    for node in nodes:
        shapes_ok = all(isinstance(node.get(k, {}), dict) for k in ("properties", "patternProperties"))
        if "unevaluatedProperties" in node and shapes_ok:
            try:
                found = _Found()
                _collect(node, root, found, conditional=False, seen=set(), top=True)
            except _Unknown:
                continue
            if found.open or _covered(found):
                plans.append((node, found))
    for node, found in plans:
        rest = node.pop("unevaluatedProperties")
        if found.open:
            continue
        props = node.setdefault("properties", {})
        for name in sorted(found.names - set(props)):
            props[name] = True
        if found.patterns - set(node.get("patternProperties", {})):
            patterns = node.setdefault("patternProperties", {})
            for pattern in sorted(found.patterns - set(patterns)):
                patterns[pattern] = True
        node["additionalProperties"] = rest
    return bool(plans)


def _with_targets(
    root: dict[str, Any], nodes: list[dict[str, Any]], walk: Callable[[Any], list[dict[str, Any]]]
) -> list[dict[str, Any]]:
    known = {id(n) for n in nodes}
    found, queue = list(nodes), list(nodes)
    while queue:
        ref = queue.pop().get("$ref")
        try:
            target = _target(root, ref) if isinstance(ref, str) else None
        except _Unknown:
            continue
        if isinstance(target, dict) and id(target) not in known:
            more = [n for n in walk(target) if id(n) not in known]
            known.update(id(n) for n in more)
            found += more
            queue += more
    return found


def _covered(found: _Found) -> bool:
    """Every name and pattern a conditional part evaluates is evaluated unconditionally anyway."""
    if not found.cond_patterns <= found.patterns:
        return False
    return all(name in found.names or _matched(name, found.patterns) for name in found.cond_names)


def _matched(name: str, patterns: set[str]) -> bool:
    """Some pattern finds `name`, read the same with ASCII and with Unicode classes (ECMA's \\d and \\w are ASCII,
    its \\s is not): a pattern where the two differ counts as no match."""
    for pattern in patterns:
        try:
            ascii_hit = re.search(pattern, name, re.ASCII) is not None
            unicode_hit = re.search(pattern, name) is not None
        except re.error:
            continue
        if ascii_hit and unicode_hit:
            return True
    return False


def _collect(node: Any, root: dict[str, Any], found: _Found, *, conditional: bool, seen: set[int], top: bool) -> None:
    """Add what `node` and its in-place subschemas evaluate; `conditional`: they count only where they pass."""
    if not isinstance(node, dict):
        return  # true evaluates nothing; false never passes
    if id(node) in seen:
        return  # a $ref cycle through in-place keywords adds nothing new
    seen = seen | {id(node)}
    if any(k in node for k in _UNKNOWN):
        raise _Unknown
    names = found.cond_names if conditional else found.names
    patterns = found.cond_patterns if conditional else found.patterns
    if isinstance(node.get("properties"), dict):
        names.update(node["properties"])
    if isinstance(node.get("patternProperties"), dict):
        patterns.update(node["patternProperties"])
    for key in _OPEN:
        if key in node and not (top and key == "unevaluatedProperties"):
            if conditional:
                raise _Unknown
            found.open = True
    if isinstance(node.get("$ref"), str):
        _collect(_target(root, node["$ref"]), root, found, conditional=conditional, seen=seen, top=False)
    for sub in node["allOf"] if isinstance(node.get("allOf"), list) else []:
        _collect(sub, root, found, conditional=conditional, seen=seen, top=False)
    for key in _CONDITIONAL_ONE:
        if key in node:
            _collect(node[key], root, found, conditional=True, seen=seen, top=False)
    for key in _CONDITIONAL_MANY:
        for sub in node[key] if isinstance(node.get(key), list) else []:
            _collect(sub, root, found, conditional=True, seen=seen, top=False)
    for key in ("dependentSchemas", "dependencies"):
        for sub in node[key].values() if isinstance(node.get(key), dict) else []:
            _collect(sub, root, found, conditional=True, seen=seen, top=False)


def _target(root: dict[str, Any], ref: str) -> Any:
    """The subschema a local `#` / `#/...` $ref points at."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        raise _Unknown
    node = walk(root, ref[2:].split("/"))
    if node is MISSING:
        raise _Unknown
    return node
