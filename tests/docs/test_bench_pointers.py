"""Comments and docs that point into bench/README.md for a figure name its claim by heading: each quoted name
after `bench/README.md` must begin one of that file's headings, so a renamed or dropped claim fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("server", "engine", "demo", "bench", "tests", "fuzz", "docs", "deploy")
SUFFIXES = {".py", ".cpp", ".h", ".md", ".sh", ".toml", ".yaml", ".yml"}
# `bench/README.md, "A"` or `bench/README.md "A", "B"`, across a line break and a comment's leading `//` / `#`
NAME = r'"\w[^"\n]*"'
POINTER = re.compile(rf"bench/README\.md\)?,?\s+((?:(?://|#)\s*)?{NAME}(?:,?\s*(?:(?://|#)\s*)?(?:and\s+)?{NAME})*)")
QUOTED = re.compile(r'"(\w[^"\n]*)"')


def headings() -> list[str]:
    text = (ROOT / "bench" / "README.md").read_text()
    return [m.group(1).strip() for m in re.finditer(r"^#{2,4} (.+)$", text, re.MULTILINE)]


def pointers(text: str) -> list[str]:
    return [name for m in POINTER.finditer(text) for name in QUOTED.findall(m.group(1))]


def test_pointers_name_a_heading() -> None:
    known = headings()
    files = [ROOT / "README.md"] + [
        p for folder in FOLDERS for p in sorted((ROOT / folder).rglob("*")) if p.suffix in SUFFIXES and p.is_file()
    ]
    dangling = [
        f"{path.relative_to(ROOT)}: {name!r}"
        for path in files
        if path != Path(__file__)
        for name in pointers(path.read_text(errors="replace"))
        if not any(h.startswith(name) for h in known)
    ]
    assert dangling == []


def test_the_pointer_pattern_reads_each_form() -> None:
    text = (
        'see (bench/README.md, "Huge pages") and [bench/README.md](../bench/README.md), "Embeddings" and "Rerank"\n'
        '// lack on cold weights (bench/README.md,\n// "The bf16 GEMM kernel", "Prefill products").\n'
        'figures: bench/README.md "Tensor parallel"; plain bench/README.md holds the figures "not a pointer"\n'
        'DOCS = ("bench/README.md", "pyproject.toml")'
    )
    assert pointers(text) == [
        "Huge pages",
        "Embeddings",
        "Rerank",
        "The bf16 GEMM kernel",
        "Prefill products",
        "Tensor parallel",
    ]
