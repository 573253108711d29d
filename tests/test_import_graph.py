"""No import cycles among the modules of server/ and engine/, counting every import: at the top, inside
functions, under TYPE_CHECKING, and `importlib.import_module("...")` with a literal name."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("server", "engine", "demo")


def module_files(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under each package folder of `root`."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _imported_names(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """The dotted names an import statement (or a literal import_module call) may load."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # relative: up from this module's package
            package = module.split(".") if is_package else module.split(".")[:-1]
            keep = len(package) - (node.level - 1)
            base = ".".join(package[:keep] + ([base] if base else []))
        return [base] + [f"{base}.{alias.name}" for alias in node.names]  # `from pkg import module` loads it
    if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
            return [node.args[0].value]
    return []


def import_graph(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    """Module -> the project modules it imports. An import of a.b.c counts as one of the deepest project
    module it names (a.b.c, else a.b, ...), and as one of each package above that which the importer is not
    inside (importing a.b.c runs a/__init__.py and a/b/__init__.py first)."""
    files = module_files(root, packages)
    graph: dict[str, set[str]] = {name: set() for name in files}
    for module, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            for name in _imported_names(node, module, path.name == "__init__.py"):
                while name and name not in files:
                    name = name.rpartition(".")[0]
                while name:
                    if name != module and not module.startswith(name + "."):
                        graph[module].add(name)
                    name = name.rpartition(".")[0]
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph[succ]))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return sorted(found)


def _cycle_report(found: list[list[str]]) -> str:
    return f"{len(found)} import cycle(s):\n" + "\n".join("  " + " <-> ".join(c) for c in found)


def test_server_and_engine_have_no_import_cycles() -> None:
    found = cycles(import_graph(REPO))
    assert not found, _cycle_report(found)


def test_the_graph_sees_every_kind_of_import(tmp_path: Path) -> None:
    """A tiny package whose cycles hide in a function, under TYPE_CHECKING, behind relative imports,
    `from pkg import module` and import_module: each one is found; the acyclic part is not reported."""
    files = {
        "pkg/__init__.py": "",
        "pkg/a.py": "def f():\n    from pkg import b\n",
        "pkg/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .sub import c\n",
        "pkg/sub/__init__.py": "from other import x\n",
        "pkg/sub/c.py": "from .. import a\n",
        "pkg/d.py": "import importlib\nimportlib.import_module('pkg.e')\n",
        "pkg/e.py": "import pkg.d as d\n",
        "pkg/leaf.py": "import os\nfrom pkg import a\n",  # imports into a cycle, is in none
        "other/__init__.py": "",
        "pkg/sub/y.py": "",
        "other/x.py": "import pkg.sub.y\n",  # runs pkg/sub/__init__.py, which imports this module
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path, ("pkg", "other"))
    assert graph["pkg.sub.c"] == {"pkg.a"}  # `from .. import a`; its own packages are already running
    assert graph["other.x"] == {"pkg", "pkg.sub", "pkg.sub.y"}
    assert cycles(graph) == [["other.x", "pkg.sub"], ["pkg.a", "pkg.b", "pkg.sub.c"], ["pkg.d", "pkg.e"]]
    assert "1 import cycle(s):\n  pkg.d <-> pkg.e" == _cycle_report([["pkg.d", "pkg.e"]])
