"""The benchmarks' judge of a structured answer: jsonschema with the schema's own `$schema` draft (2020-12 when it
names none), formats checked where jsonschema can, and regexes read as ECMA 262 where Python's `re` cannot read
them (`\\p{Zs}`, a Unicode property escape JSON Schema patterns may use: jsonschema's own keywords raise re.error,
a crash of the judge rather than a verdict), through the `regex` package when it is installed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema


def search(pattern: str, text: str) -> bool:
    """`pattern` matches somewhere in `text`: Python's `re`, else `regex` (Unicode property escapes)."""
    try:
        return re.search(pattern, text) is not None
    except re.error:
        import regex  # why late: only patterns `re` cannot read need it (a dependency of transformers)

        return regex.search(pattern, text) is not None


def _pattern(validator: Any, pattern: str, instance: Any, schema: Any) -> Iterator[jsonschema.ValidationError]:
    if validator.is_type(instance, "string") and not search(pattern, instance):
        yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")


def _pattern_properties(validator: Any, patterns: dict[str, Any], instance: Any, schema: Any) -> Iterator[Any]:
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        for key, value in instance.items():
            if search(pattern, key):
                yield from validator.descend(value, subschema, path=key, schema_path=pattern)


def _additional_properties(validator: Any, extra: Any, instance: Any, schema: Any) -> Iterator[Any]:
    if not validator.is_type(instance, "object"):
        return
    known = schema.get("properties", {})
    patterns = list(schema.get("patternProperties", {}))
    others = [k for k in instance if k not in known and not any(search(p, k) for p in patterns)]
    if validator.is_type(extra, "object"):
        for key in others:
            yield from validator.descend(instance[key], extra, path=key)
    elif not extra and others:
        yield jsonschema.ValidationError(f"Additional properties are not allowed ({', '.join(map(repr, others))})")


def validator(schema: Any) -> Any:
    """A validator of the schema's draft whose regex keywords read ECMA 262's Unicode property escapes."""
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    keywords = {"pattern": _pattern, "patternProperties": _pattern_properties}
    if "additionalProperties" in cls.VALIDATORS:
        keywords["additionalProperties"] = _additional_properties
    ecma = jsonschema.validators.extend(cls, keywords)
    return ecma(schema, format_checker=cls.FORMAT_CHECKER)


def check(schema: Any, text: str) -> str | None:
    """None when `text` is JSON that satisfies `schema`, else why not (the best-matching error); raises where the
    judge cannot read the schema (a $ref to a document it does not have)."""
    try:
        value = json.loads(text)
    except ValueError as e:
        return f"not JSON: {e}"
    error = jsonschema.exceptions.best_match(validator(schema).iter_errors(value))
    return None if error is None else f"{error.validator}: {error.message[:120]}"
