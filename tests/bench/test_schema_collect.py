"""The corpus collector's bundling: a schema's refs to other documents of its source become refs into its $defs."""

from __future__ import annotations

from typing import Any

import jsonschema

from bench.schemas.collect import _bundle

DOCS: dict[str, Any] = {
    "https://example.org/base.json": {
        "$id": "https://example.org/base",
        "$schema": "x",
        "definitions": {
            "opts": {
                "type": "object",
                "required": ["n"],
                "properties": {"n": {"$ref": "#/definitions/count"}, "peer": {"$ref": "other.json#/definitions/word"}},
            },
            "count": {"type": "integer", "minimum": 1},
        },
    },
    "https://example.org/other.json": {
        "definitions": {"word": {"type": "string", "pattern": "^w"}, "back": {"$ref": "base.json"}}
    },
}


def load(doc: str) -> Any:
    return DOCS.get(doc) or DOCS.get(doc + ".json")


def test_external_refs_are_bundled_and_rebased() -> None:
    root = {
        "properties": {"o": {"$ref": "https://example.org/base#/definitions/opts"}, "l": {"$ref": "#/x"}},
        "x": {"type": "null"},
    }
    out = _bundle(root, "https://example.org/root.json", load)
    assert out["properties"] == {"o": {"$ref": "#/$defs/base/definitions/opts"}, "l": {"$ref": "#/x"}}
    base = out["$defs"]["base"]
    assert "$id" not in base and "$schema" not in base  # its refs resolve in the bundle, not at its old address
    assert base["definitions"]["opts"]["properties"]["n"] == {"$ref": "#/$defs/base/definitions/count"}
    assert base["definitions"]["opts"]["properties"]["peer"] == {"$ref": "#/$defs/other/definitions/word"}
    assert out["$defs"]["other"]["definitions"]["back"] == {"$ref": "#/$defs/base"}  # a cycle, bundled once
    v = jsonschema.Draft7Validator(out)
    assert v.is_valid({"o": {"n": 2, "peer": "wa"}})
    assert (
        not v.is_valid({"o": {"n": 0}}) and not v.is_valid({"o": {"n": 1, "peer": "x"}}) and not v.is_valid({"o": {}})
    )


def test_refs_to_documents_the_source_lacks_stay_as_published() -> None:
    root = {"$defs": {"a": {"type": "string"}}, "items": {"$ref": "https://xunit.net/schema.json"}}
    assert _bundle(root, "https://example.org/root.json", load) == root
