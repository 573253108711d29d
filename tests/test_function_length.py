"""No function or method in server/ or engine/ is longer than 60 lines (from `def` to its last line,
docstring and comments included; nested functions count on their own and within their parent)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_LINES = 60


def long_functions(
    root: Path, folders: tuple[str, ...] = ("server", "engine", "demo"), limit: int = MAX_LINES
) -> list[str]:
    """`path:line name (N lines)` for every function under `folders` longer than `limit` lines."""
    found = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    assert node.end_lineno is not None
                    length = node.end_lineno - node.lineno + 1
                    if length > limit:
                        found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_no_function_is_over_60_lines() -> None:
    found = long_functions(REPO)
    assert not found, f"{len(found)} function(s) over {MAX_LINES} lines:\n" + "\n".join(found)


def test_the_count_starts_at_def_and_ends_at_the_last_line(tmp_path: Path) -> None:
    sixty = '@decorator\ndef sixty():\n    """Doc."""\n' + "    x = 1\n" * 58  # def, docstring, 58 lines
    sixty_one = (
        'class C:\n    async def sixty_one(self):\n        """Doc."""\n'
        + "        x = 1\n" * 57
        + "        # a comment\n        return 1\n"
    )
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(sixty + sixty_one)
    assert long_functions(tmp_path, ("pkg",)) == ["pkg/m.py:63 sixty_one (61 lines)"]
