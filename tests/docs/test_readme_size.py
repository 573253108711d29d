"""The front pages stay short enough to read in one sitting, and no line of the docs needs a scroll bar:
README.md at most 150 lines, docs/architecture.md at most 400; reference detail belongs on the pages under docs/."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MOST_LINES = {"README.md": 150, "docs/architecture.md": 400}
WIDEST = 120
PAGES = ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))


def too_wide(text: str, widest: int = WIDEST) -> list[int]:
    """Line numbers (from 1) of the lines longer than `widest` characters."""
    return [n for n, line in enumerate(text.splitlines(), 1) if len(line) > widest]


@pytest.mark.parametrize("page", sorted(MOST_LINES))
def test_front_pages_stay_short(page: str) -> None:
    lines = len((ROOT / page).read_text().splitlines())
    assert lines <= MOST_LINES[page], f"{page} has {lines} lines: move reference detail to a page under docs/"


@pytest.mark.parametrize("page", PAGES)
def test_no_line_is_wider_than_the_limit(page: str) -> None:
    assert too_wide((ROOT / page).read_text()) == [], f"{page}: lines over {WIDEST} characters"


def test_too_wide_finds_a_long_line() -> None:
    assert too_wide("short\n" + "x" * (WIDEST + 1) + "\nshort") == [2]
    assert too_wide("x" * WIDEST) == []
