"""docs/modules.md is generated: one line per module of server/, engine/ and demo/ (its path in its package and
its docstring's first sentence; a C++ file's leading comment), and this test fails when the page is stale.
Regenerate with `python tests/docs/test_modules_page.py`."""

from __future__ import annotations

import ast
import re
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "modules.md"
PACKAGES = ("server", "engine", "demo")
SOURCES = {".py", ".cpp", ".h"}
NAME_WIDTH = 23
WIDEST = 120
MOST_LINES = 2
HEADER = """# Modules

Generated from each module's docstring (a C++ file's leading comment): its first sentence; the module says more.
How the packages fit together: [architecture.md](architecture.md). Regenerate with
`python tests/docs/test_modules_page.py`; tests/docs/test_modules_page.py fails when this page is stale.
"""
# A period that ends a sentence: followed by white space or the end, not part of an abbreviation.
_END = re.compile(r"(?<!\be\.g)(?<!\bi\.e)(?<!\betc)(?<!\bvs)\.(?:\s|$)")


def first_sentence(text: str) -> str:
    """The first paragraph's first sentence, on one line, without its closing period."""
    paragraph = " ".join(text.strip().split("\n\n", 1)[0].split())
    end = _END.search(paragraph)
    return paragraph[: end.start()] if end else paragraph.rstrip(".")


def leading_comment(source: str) -> str:
    """A C++ file's leading `//` comment lines, their markers dropped."""
    lines = []
    for line in source.splitlines():
        if not line.startswith("//"):
            break
        lines.append(line[2:].strip())
    return "\n".join(lines)


def summary(path: Path) -> str:
    source = path.read_text()
    if path.suffix == ".py":
        doc = ast.get_docstring(ast.parse(source, str(path))) or ""
    else:
        doc = leading_comment(source)
    return first_sentence(doc) if doc.strip() else "(no docstring)"


def _order(path: Path) -> tuple[bool, str]:
    return (path.name != "__init__.py", path.name)


def _row(path: Path) -> str:
    """`name  summary`, wrapped at WIDEST under the summary's column."""
    text = f"{path.name:<{NAME_WIDTH - 1}} {summary(path)}"
    indent = " " * NAME_WIDTH
    lines = textwrap.wrap(text, WIDEST - 2, subsequent_indent=indent, break_on_hyphens=False)
    if len(lines) > MOST_LINES:  # the page stays a list: the module's own docstring has the rest
        lines = [*lines[: MOST_LINES - 1], lines[MOST_LINES - 1] + " …"]
    return "\n".join(lines)


def render(root: Path = ROOT) -> str:
    """The page for the tree under root: a section per folder holding source files, its files in order."""
    sections = [HEADER]
    for package in PACKAGES:
        folders = sorted({p.parent for p in (root / package).rglob("*") if p.suffix in SOURCES and p.is_file()})
        for folder in folders:
            if "__pycache__" in folder.parts:
                continue
            files = sorted((p for p in folder.iterdir() if p.suffix in SOURCES and p.is_file()), key=_order)
            rows = [_row(p) for p in files]
            sections.append(f"## {folder.relative_to(root).as_posix()}/\n\n```\n" + "\n".join(rows) + "\n```\n")
    return "\n".join(sections)


def test_modules_page_is_current() -> None:
    assert PAGE.read_text() == render(), (
        "docs/modules.md is stale (a module added, moved or its docstring changed): "
        "run `python tests/docs/test_modules_page.py`"
    )


def test_first_sentence_stops_at_a_sentence_end() -> None:
    assert first_sentence("One job, e.g. this one. More.\n\nNext paragraph.") == "One job, e.g. this one"
    assert first_sentence("Reads server/cli.py and\nengine/x.py") == "Reads server/cli.py and engine/x.py"
    assert (
        leading_comment("// A kernel.\n// Built by build.py.\n#include <x>\n// no") == "A kernel.\nBuilt by build.py."
    )


if __name__ == "__main__":
    PAGE.write_text(render())
    sys.exit(0)
