"""Names the README, the pages under docs/, bench/README.md and pyproject.toml's comments mention still exist: file
paths, `python -m` modules, `module.name` references, the demo checkpoint's cache folder and the pytest markers
declared."""

from __future__ import annotations

import ast
import importlib.util
import re
import tomllib
from pathlib import Path

import pytest

from demo import checkpoints as random_checkpoint

ROOT = Path(__file__).resolve().parents[2]
ROOT_DOCS = ("README.md", "bench/README.md", "pyproject.toml")
DOCS = ROOT_DOCS + tuple(sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md")))
# Programs the docs show being run elsewhere (a router in front of the replicas), not dependencies of the project.
ELSEWHERE = {"sglang_router"}
TOP = ("server", "engine", "demo", "tests", "bench", "fuzz", "docs", ".ci", "deploy")
FIRST_PARTY = ("server", "engine", "demo", "bench")


def text(doc: str) -> str:
    return (ROOT / doc).read_text()


def mentioned_paths(doc: str) -> set[str]:
    """Paths under the repository's top folders, e.g. server/http/direct_body.py, docs/deployment.md, .ci/run."""
    found = re.findall(rf"(?<![\w./-])((?:{'|'.join(map(re.escape, TOP))})/[\w./-]*)", text(doc))
    return {p.rstrip(".") for p in found}


def mentioned_modules(doc: str) -> set[str]:
    """`python -m X` targets and backquoted first-party references such as `server.app:create_app()`."""
    t = text(doc)
    run = set(re.findall(r"python -m ([\w.]+)", t))
    refs = set(re.findall(rf"`((?:{'|'.join(FIRST_PARTY)})\.[\w.:]+)", t))
    return {m for m in run | refs if not re.search(r"\.[A-Z]+$", m)}  # `bench.NAME` is a placeholder


def _module_file(dotted: str) -> Path | None:
    base = ROOT.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py", base / "__main__.py"):
        if candidate.is_file():
            return candidate
    return None


def _defines(file: Path, name: str) -> bool:
    for node in ast.parse(file.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return True
    return False


def resolves(ref: str) -> bool:
    """A module (first-party: its file; else importable), or module.attr / module:attr defined in that module."""
    parts = ref.rstrip(".").replace(":", ".").split("(")[0].split(".")
    if parts[0] not in FIRST_PARTY:
        return parts[0] in ELSEWHERE or importlib.util.find_spec(parts[0]) is not None
    for cut in range(len(parts), 0, -1):
        file = _module_file(".".join(parts[:cut]))
        if file is not None:
            rest = parts[cut:]
            return not rest or (len(rest) == 1 and _defines(file, rest[0]))
    return False


@pytest.mark.parametrize("doc", DOCS)
def test_mentioned_paths_exist(doc: str) -> None:
    paths = mentioned_paths(doc)
    assert paths or doc not in ROOT_DOCS[:2]  # the scan finds paths at all
    assert sorted(p for p in paths if not (ROOT / p).exists()) == []


@pytest.mark.parametrize("doc", DOCS)
def test_mentioned_modules_exist(doc: str) -> None:
    modules = mentioned_modules(doc)
    assert modules or doc not in ROOT_DOCS[:2]
    assert sorted(m for m in modules if not resolves(m)) == []


def test_readme_demo_folder_is_the_one_the_server_builds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    names = set(re.findall(r"~/\.cache/spindle/([\w.-]+)", text("README.md")))
    assert len(names) == 1, names
    (tmp_path / names.pop()).mkdir()  # an existing demo is served as it is: nothing is built
    monkeypatch.setenv("SPINDLE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(random_checkpoint, "make_demo", lambda path: Path(path))  # a wrong name must not build one
    assert random_checkpoint.demo_checkpoint_path().parent == tmp_path
    assert random_checkpoint.demo_checkpoint_path().is_dir()


def test_declared_markers_are_used() -> None:
    """Every marker pyproject declares is applied by some test (an unused one misleads, e.g. `-m "not slow"`)."""
    ini = tomllib.loads(text("pyproject.toml"))["tool"]["pytest"]["ini_options"]
    sources = "".join(p.read_text() for folder in ("tests", "fuzz") for p in (ROOT / folder).rglob("*.py"))
    for marker in ini.get("markers", []):
        name = marker.split(":")[0].strip()
        assert re.search(rf"mark\.{name}\b", sources), f"marker {name!r} is declared but no test uses it"


def test_ci_runs_the_readme_commands() -> None:
    """README's first code block (set up, test) is what .ci/run runs, but for pip's `python -m` and `-q`, after
    .ci/system-packages (the distribution's packages some tests drive, which the README names beside the block)."""
    first = re.search(r"```bash\n(.*?)```", text("README.md"), re.S)
    assert first
    readme = [line.split("#")[0].strip() for line in first.group(1).splitlines() if line.strip()]
    ci = [
        line.strip().replace("python -m pip install -q ", "pip install ")
        for line in text(".ci/run").splitlines()
        if line.strip() and not line.startswith(("#", "set ", "cd ", "bash .ci/system-packages"))
    ]
    assert readme == ci == ["pip install -e '.[test]'", "python -m pytest -q"]
