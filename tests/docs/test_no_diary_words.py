"""The repository speaks of the product, not of how or when it was written: no tracked text file may say
"session" followed by a number, or "session" after "this", "last" or "next" (any case). Hits are reported
as file:line. Every file `git ls-files` lists is read, binary ones (a NUL byte) excepted; without git (an
unpacked archive) the tree is walked instead. "session" in other senses (`scope="session"`,
`aiohttp.ClientSession`, an HTTP session) does not match."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DIARY = re.compile(r"\bsessions?\s+\d+|\b(?:this|last|next)\s+session\b", re.IGNORECASE)
# Walked only when git cannot list the files: tool caches and build output, never part of the repository.
NOT_SOURCE = {".git", "__pycache__", ".mypy_cache", ".pytest_cache", ".ruff_cache", ".venv", "node_modules"}


def repository_files(root: Path, git: str = "git") -> list[Path]:
    """The files git tracks under root, or every file under root when git cannot list them."""
    try:
        listed = subprocess.run([git, "-C", str(root), "ls-files", "-z"], capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        found = []
        for folder, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if d not in NOT_SOURCE and not d.endswith(".egg-info")]
            found += [Path(folder, f) for f in files]
        return sorted(found)
    return [root / name for name in os.fsdecode(listed).split("\0") if name]


def diary_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, line) of each line of a text file that narrates; nothing for a binary or missing file."""
    try:
        data = path.read_bytes()
    except (FileNotFoundError, IsADirectoryError):  # listed by git but deleted in the work tree, or a submodule
        return []
    if b"\0" in data:
        return []
    text = data.decode("utf-8", errors="replace")
    return [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1) if DIARY.search(line)]


def diary_hits(root: Path, git: str = "git") -> list[str]:
    return [
        f"{path.relative_to(root)}:{n}: {line}" for path in repository_files(root, git) for n, line in diary_lines(path)
    ]


def test_no_file_narrates_how_it_was_written() -> None:
    assert diary_hits(ROOT) == []


def test_the_matcher_flags_each_phrase_and_nothing_else(tmp_path: Path) -> None:
    word = "Session"  # the phrases are built here, so this file does not hold them
    lines = [
        f"# measured in {word.lower()} 7",
        f"{word}s 9-12 had another CPU",
        f"as in THIS {word.upper()}",
        f"the last {word}'s figures",
        f"left for the next  {word.lower()}",
        'scope="session"',
        "async with aiohttp.ClientSession() as http:",
        "an HTTP session keeps its connection; a sessionless client",
        "a sessions_dir, next_session(), 7 sessions",
    ]
    (tmp_path / "notes.md").write_text("\n".join(lines) + "\n")
    assert [n for n, _ in diary_lines(tmp_path / "notes.md")] == [1, 2, 3, 4, 5]


def test_binary_files_are_skipped_and_the_tree_is_walked_without_git(tmp_path: Path) -> None:
    phrase = "this " + "session"
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.txt").write_text(f"ok\n{phrase}\n")
    (tmp_path / "b.bin").write_bytes(b"\0\1" + phrase.encode())
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "c.txt").write_text(phrase)
    assert diary_hits(tmp_path, git=str(tmp_path / "no-git")) == [f"{Path('sub', 'a.txt')}:2: {phrase}"]
