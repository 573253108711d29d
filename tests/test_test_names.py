"""No two test files share a name: pytest imports test modules by their basename here (rootdir-relative, no
packages), so a second `test_x.py` in another folder stops the whole collection."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def repeated_names(files: list[Path]) -> list[str]:
    counts = Counter(f.name for f in files if f.name.startswith("test_"))
    return sorted(name for name, n in counts.items() if n > 1)


def test_every_test_file_has_a_name_of_its_own() -> None:
    assert repeated_names(list(TESTS.rglob("test_*.py"))) == []


def test_a_repeated_name_is_found() -> None:
    assert repeated_names([Path("a/test_x.py"), Path("b/test_x.py"), Path("b/test_y.py")]) == ["test_x.py"]
