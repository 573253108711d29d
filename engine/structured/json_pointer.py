"""Walking a JSON pointer (RFC 6901) into a schema: the `$ref` targets the schema rewrites and checks follow."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

MISSING: Any = object()  # what `walk` returns where the pointer leads nowhere (a found node may be None)


def walk(root: Any, parts: Iterable[str]) -> Any:
    """The node the pointer's reference tokens (`~1` and `~0` still escaped) lead to from root, or MISSING."""
    node = root
    for part in parts:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return MISSING
    return node
