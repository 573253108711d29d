"""No import cycles among the packages of server/ and engine/: each folder is one node, and an import of any module
in another folder is an arrow to that folder (tests/test_import_graph.py's imports: at the top, inside functions,
under TYPE_CHECKING). A folder and the folders above or below it are not compared (importing a.b.c runs a/b's
__init__ first). Module-level acyclicity is not enough: two packages whose modules import each other in a chain
cannot be read, tested or moved apart."""

from __future__ import annotations

from pathlib import Path

from tests.test_import_graph import REPO, cycles, import_graph, module_files

PACKAGES = ("server", "engine")


def package_graph(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    """Folder (dotted) -> the folders its modules import, related folders (one inside the other) left out."""
    files = module_files(root, packages)
    folder = {module: ".".join(path.relative_to(root).parent.parts) for module, path in files.items()}
    graph: dict[str, set[str]] = {name: set() for name in folder.values()}
    for module, targets in import_graph(root, packages).items():
        a = folder[module]
        for target in targets:
            b = folder[target]
            if a != b and not a.startswith(b + ".") and not b.startswith(a + "."):
                graph[a].add(b)
    return graph


def test_server_and_engine_packages_have_no_import_cycles() -> None:
    found = cycles(package_graph(REPO))
    assert not found, f"{len(found)} package cycle(s):\n" + "\n".join("  " + " <-> ".join(c) for c in found)


def test_a_cycle_through_modules_that_do_not_import_each_other_is_found(tmp_path: Path) -> None:
    """p.a1 -> q.b1 and q.b2 -> p.a2: no module cycle, but p <-> q; a child package importing its parent is none."""
    files = {
        "p/__init__.py": "",
        "p/a1.py": "from q import b1\n",
        "p/a2.py": "",
        "q/__init__.py": "",
        "q/b1.py": "",
        "q/b2.py": "def f():\n    import p.a2\n",
        "q/sub/__init__.py": "",
        "q/sub/c.py": "from q import b1\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cycles(import_graph(tmp_path, ("p", "q"))) == []
    graph = package_graph(tmp_path, ("p", "q"))
    assert graph["q.sub"] == set()
    assert cycles(graph) == [["p", "q"]]
