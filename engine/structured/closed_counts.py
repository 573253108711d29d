"""`minProperties` / `maxProperties` on a closed object (`additionalProperties: false`, no patternProperties) as
what llguidance enforces: it takes them only where every listed key is required (its lenient mode reads the rest as
unsatisfiable), so a closed object of n listed keys gets, exactly:
- `maxProperties` >= n dropped (no answer can hold more keys than are listed);
- `minProperties` k as an anyOf of `required` over each set of the optional keys that makes k with the required
  ones, `maxProperties` m < n as an anyOf of `properties: {key: false}` over each set of the optional keys whose
  absence leaves at most m, both where there are at most MAX_SUBSETS such sets (together).
"""

from __future__ import annotations

import itertools
import math
from typing import Any

MAX_SUBSETS = 128  # anyOf branches llguidance intersects with the object, one per set of keys


def closed_counts(nodes: list[dict[str, Any]]) -> bool:
    """Rewrite the counts of every closed object in `nodes` as above; True when one changed."""
    changed = False
    for node in nodes:
        props = node.get("properties")
        if node.get("additionalProperties") is not False or "patternProperties" in node or not isinstance(props, dict):
            continue
        given = node.get("required")
        required: list[Any] = given if isinstance(given, list) else []
        listed = [k for k in props if props[k] is not False]
        optional = [k for k in listed if k not in required]
        low, high = _count(node, "minProperties"), _count(node, "maxProperties")
        if high is not None and high >= len(listed):
            del node["maxProperties"]
            changed, high = True, None
        parts: list[list[dict[str, Any]] | None] = []
        if low is not None:  # of the optional keys, at least `need` present
            need = _subsets(optional, low - (len(listed) - len(optional)))
            parts.append(None if need is None else [{"required": list(keys)} for keys in need])
        if high is not None:  # of the optional keys, at least `absent` left out
            absent = _subsets(optional, len(optional) - max(high - (len(listed) - len(optional)), 0))
            parts.append(None if absent is None else [{"properties": dict.fromkeys(keys, False)} for keys in absent])
        if (
            "anyOf" in node
            or any(p is None for p in parts)
            or math.prod(max(len(p or ()), 1) for p in parts) > MAX_SUBSETS
        ):
            continue  # unsatisfiable (left to the backend's refusal), too many sets, or an anyOf already there
        for key in ("minProperties", "maxProperties"):
            node.pop(key, None)
        branches = [p for p in parts if p]
        if len(branches) == 1:
            node["anyOf"] = branches[0]
        elif branches:
            node["allOf"] = [*node.get("allOf", []), *({"anyOf": b} for b in branches)]
        changed = changed or bool(parts)
    return changed


def _count(node: dict[str, Any], key: str) -> int | None:
    value = node.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _subsets(keys: list[Any], size: int) -> list[tuple[Any, ...]] | None:
    """Each `size` of `keys` (none: no set needed), or None when there are not that many keys or too many sets."""
    if size > len(keys) or math.comb(len(keys), max(size, 0)) > MAX_SUBSETS:
        return None
    return list(itertools.combinations(keys, size)) if size > 0 else []
