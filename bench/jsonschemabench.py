"""JSONSchemaBench (Geng et al. 2025, arXiv 2501.10868): 9,558 real-world JSON schemas in ten categories, read from
a local copy of the `data/` folder of github.com/guidance-ai/jsonschemabench (110 MB, not vendored), cloned into
<spindle cache>/jsonschemabench on first use. `sample` draws every k-th schema of each category from an offset, so
two offsets give two disjoint samples spread over every category alike.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from engine.cache_root import cache_root

REPOSITORY = "https://github.com/guidance-ai/jsonschemabench"
CATEGORIES = (
    "Github_trivial",
    "Github_easy",
    "Github_medium",
    "Github_hard",
    "Github_ultra",
    "Glaiveai2K",
    "Kubernetes",
    "Snowplow",
    "WashingtonPost",
    "JsonSchemaStore",
)


def data_dir(root: Path | None = None) -> Path:
    """The folder of category folders, cloned (sparse: `data/` only) when it is not there yet."""
    base = root or cache_root() / "jsonschemabench"
    data = base / "data"
    if data.is_dir():
        return data
    print(f"JSONSchemaBench is not in {base}: cloning {REPOSITORY} (data/ only, ~110 MB)", file=sys.stderr)
    clone = ["git", "clone", "--depth", "1", "--filter=blob:none", "--sparse", REPOSITORY, str(base)]
    try:
        subprocess.run(clone, check=True)
        subprocess.run(["git", "-C", str(base), "sparse-checkout", "set", "data"], check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        raise SystemExit(
            f"cannot fetch JSONSchemaBench ({e}); put the `data/` folder of {REPOSITORY} at {data} by hand"
        ) from e
    return data


def sample(data: Path, every: int, offset: int, only: list[str] | None = None) -> list[tuple[str, str, Any]]:
    """(category, file stem, schema) of every `every`-th schema of each category (files in name order), starting
    at index `offset`, the categories taken in turn (a run cut short has covered them alike); a category missing
    from `data` is skipped with a line on stderr."""
    lists = []
    for category in CATEGORIES:
        if only and category not in only:
            continue
        folder = data / category
        if not folder.is_dir():
            print(f"JSONSchemaBench: no {folder}, category skipped", file=sys.stderr)
            continue
        lists.append([(category, path.stem) for path in sorted(folder.glob("*.json"))[offset::every]])
    turns = itertools.chain.from_iterable(itertools.zip_longest(*lists))
    return [(c, stem, json.loads((data / c / f"{stem}.json").read_text())) for c, stem in filter(None, turns)]
