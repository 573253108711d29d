"""Every third-party import in server/ and engine/ is declared in pyproject's `dependencies`, and every one in
tests/ and fuzz/ in `dependencies` or the `test` extra: nothing works only because it arrived transitively."""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import re
import sys
import tomllib
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIRST_PARTY = {"server", "engine", "demo", "bench", "tests", "fuzz"}
# Imported in demo/ only to build test fixtures (demo/tokenizers.py writes Llama / Mistral tokenizers
# for random checkpoints); the server never reaches them, so they are declared in the `test` extra instead.
FIXTURE_ONLY = {"mistral_common": "demo/tokenizers.py", "sentencepiece": "demo/tokenizers.py"}


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()  # PEP 503


def declared(group: str | None) -> set[str]:
    """Distribution names in `dependencies` (group None) or in the optional-dependencies group, normalized."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = project["dependencies"] if group is None else project["optional-dependencies"][group]
    out = set()
    for req in reqs:
        m = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", req)
        assert m, req
        out.add(_normalize(m.group()))
    return out


def imports(*folders: str) -> dict[str, set[str]]:
    """Top-level names of every absolute import (module level, in functions, under TYPE_CHECKING) -> files."""
    found: dict[str, set[str]] = {}
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    found.setdefault(name.split(".")[0], set()).add(str(path.relative_to(ROOT)))
    return found


def third_party(found: dict[str, set[str]], local: set[str]) -> dict[str, set[str]]:
    return {n: f for n, f in found.items() if n not in sys.stdlib_module_names and n not in FIRST_PARTY | local}


@functools.cache
def _packages() -> Mapping[str, list[str]]:
    return importlib.metadata.packages_distributions()  # reads every installed distribution's files: once


def distributions(name: str) -> set[str]:
    """The installed distributions that provide import name `name`, normalized."""
    return {_normalize(d) for d in _packages().get(name, [])}


def test_runtime_imports_are_declared_dependencies() -> None:
    runtime, test = declared(None), declared("test")
    found = third_party(imports("server", "engine", "demo"), set())
    assert {"torch", "msgspec", "PIL", "numpy", "httpx"} <= set(found)  # the scan sees imports at all
    missing = {}
    for name, files in sorted(found.items()):
        dists = distributions(name)
        assert dists, f"{name} (imported by {sorted(files)}) is not installed: no distribution to compare"
        wanted = test if name in FIXTURE_ONLY else runtime
        if not dists & wanted:
            missing[name] = (sorted(dists), sorted(files))
    assert missing == {}, "imported by server/, engine/ or demo/ but not declared (import -> (distributions, files))"


def test_fixture_only_exceptions_are_still_fixture_only() -> None:
    """An exception that is no longer imported, or imported elsewhere, must go (or move to `dependencies`)."""
    found = third_party(imports("server", "engine", "demo"), set())
    for name, only_file in FIXTURE_ONLY.items():
        assert found.get(name) == {only_file}, (name, found.get(name))


def test_test_imports_are_declared() -> None:
    declared_any = declared(None) | declared("test")
    local = {p.stem for folder in ("tests", "fuzz") for p in (ROOT / folder).rglob("*.py")}  # conftest-path modules
    found = third_party(imports("tests", "fuzz"), local)
    assert {"pytest", "openai", "hypothesis"} <= set(found)
    missing = {n: sorted(f) for n, f in sorted(found.items()) if not distributions(n) & declared_any}
    assert missing == {}, "imported by tests/ or fuzz/ but declared nowhere in pyproject.toml"
