"""Exact rewrites of the places where llguidance would intersect a recursive $ref with other keywords ("circular
references with sibling keys are not supported"), into forms the recursive-ref fold (relaxed_schema._fold) takes:

- `{"anyOf" | "oneOf": [..., {"$ref": T}, ...], ...siblings}`: the siblings go into each branch as
  `{"allOf": [branch, siblings]}` (both distribute over a conjunction: exactly one `b and s` holds iff `s` holds
  and exactly one `b` does), so only the branch to T meets them, as an allOf the fold copies T for;
- a `properties` entry whose name a `patternProperties` regex matches, which JSON Schema intersects with that
  pattern's schema: dropped where it is the same schema (the pattern alone says the same), else, where the member
  is optional, `false` (fewer answers, each one valid).
"""

from __future__ import annotations

import re
from typing import Any

BRANCHES = ("anyOf", "oneOf")
UNEVALUATED = frozenset({"unevaluatedProperties", "unevaluatedItems"})


def distribute_siblings(nodes: list[dict[str, Any]], target: str, inert: frozenset[str]) -> bool:
    """Move the siblings of every anyOf / oneOf that has a branch `{"$ref": target}` into its branches; `inert`:
    keywords that constrain nothing (annotations, the document's own), left in place."""
    changed = False
    for node in nodes:
        for key in BRANCHES:
            branches = node.get(key)
            if not isinstance(branches, list) or {"$ref": target} not in branches:
                continue
            siblings = {k: v for k, v in node.items() if k not in inert and k not in BRANCHES}
            if not siblings or any(k in node for k in BRANCHES if k != key) or UNEVALUATED & set(siblings):
                continue  # nothing to move, two branch lists, or a keyword that sees what the branches evaluate
            node[key] = [{"allOf": [branch, siblings]} for branch in branches]
            for name in siblings:
                del node[name]
            changed = True
    return changed


def unshadow_properties(nodes: list[dict[str, Any]]) -> bool:
    """Drop or close (`false`) the `properties` entries a `patternProperties` regex also governs, as above."""
    changed = False
    for node in nodes:
        props, patterns = node.get("properties"), node.get("patternProperties")
        if not isinstance(props, dict) or not isinstance(patterns, dict) or not patterns:
            continue
        required = node.get("required")
        for name in list(props):
            hits = [schema for pattern, schema in patterns.items() if _matches(pattern, name)]
            if not hits or props[name] is False:
                continue
            if all(schema == props[name] for schema in hits):
                del props[name]
            elif not (isinstance(required, list) and name in required):
                props[name] = False
            else:
                continue
            changed = True
    return changed


def _matches(pattern: str, name: str) -> bool:
    """The regex (ECMA 262, read by Python's re: close for the patterns schemas use) matches somewhere in `name`;
    a pattern Python cannot read is taken not to match (its property is left as it is)."""
    try:
        return re.search(pattern, name) is not None
    except re.error:
        return False
