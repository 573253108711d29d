"""`id` is draft 3's and 4's name for `$id`; from draft 6 on (and in a schema that names no draft, read as 2020-12
by the output check, which goes by the root's `$schema` only) it is no keyword, yet llguidance reads it as a base URI
where a subschema names draft 4 itself, so the `$ref`s under it resolve against a document that is not there
("Resource ... is not present"). Dropping such an `id` is exact there."""

from __future__ import annotations

from typing import Any

_SCHEMA_MAPS = ("properties", "patternProperties", "definitions", "$defs", "dependentSchemas")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SCHEMA_ONE = (
    "items",
    "additionalItems",
    "additionalProperties",
    "not",
    "if",
    "then",
    "else",
    "contains",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
)


def ids_are_keywords(schema: dict[str, Any]) -> bool:
    """Drafts 3 and 4 name a schema's URI `id`."""
    dialect = schema.get("$schema")
    return isinstance(dialect, str) and any(f"json-schema.org/draft-0{n}/" in dialect for n in (3, 4))


def drop_plain_ids(schema: dict[str, Any]) -> bool:
    """Drop every string `id` of a (sub)schema beside no `$id` (only subschema places: a property named `id` or an
    `id` inside a `const` stays); True when one went."""
    changed, stack = False, [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        if isinstance(node.get("id"), str) and "$id" not in node:
            del node["id"]
            changed = True
        for key in _SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                stack.extend(node[key].values())
        for key in _SCHEMA_LISTS:
            if isinstance(node.get(key), list):
                stack.extend(node[key])
        stack.extend(node[key] for key in _SCHEMA_ONE if isinstance(node.get(key), dict))
    return changed
