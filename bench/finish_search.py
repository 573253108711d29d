"""The forced finish's search (engine/structured/finish_search.py) from a schema's start: how many tokens its
finish takes and how long the search runs, on the demo tokenizer, for schemas of bench/schemas/.

    python -m bench.finish_search [--limit 3000] [--search-module PATH] SOURCE/NAME ...

--search-module loads another copy of finish_search.py (e.g. `git show REV:engine/structured/finish_search.py`)
to compare with an earlier search. "none": no finish found within the limit and the search's tries.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import sys
import time
from pathlib import Path
from types import ModuleType

from engine.messages import StructuredOutputs
from engine.structured import finish_search
from engine.structured.llguidance_backend import LLGuidanceBackend
from engine.structured.relaxed_schema import relax

CORPUS = Path(__file__).resolve().parent / "schemas"


def _module(path: Path | None) -> ModuleType:
    if path is None:
        return finish_search
    spec = importlib.util.spec_from_file_location("finish_search_other", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("schemas", nargs="+", help="SOURCE/NAME of bench/schemas/")
    ap.add_argument("--limit", type=int, default=3000, help="most tokens the finish may take")
    ap.add_argument("--search-module", type=Path, help="another finish_search.py to run instead")
    args = ap.parse_args()
    from demo.checkpoints import demo_checkpoint_path

    folder = demo_checkpoint_path()
    config = json.loads((folder / "config.json").read_text())
    eos = json.loads((folder / "generation_config.json").read_text()).get("eos_token_id", config["eos_token_id"])
    backend = LLGuidanceBackend.from_checkpoint(folder, config["vocab_size"], eos if isinstance(eos, list) else [eos])
    search = _module(args.search_module)
    print("| schema | finish tokens | search s |\n|---|---:|---:|")
    for name in args.schemas:
        schema = json.loads((CORPUS / f"{name}.json").read_text())
        so = StructuredOutputs("json", json.dumps(relax(schema, {"whitespace_flexible": False}).schema))
        finish = backend.compile(so)._finish_with
        # an earlier search has no tokenizer argument (its finish is the walk's tokens)
        extra = (
            {"tokenizer": backend.tokenizer} if "tokenizer" in inspect.signature(search.completion).parameters else {}
        )
        t0 = time.perf_counter()
        path = search.completion(
            backend.compile(so).matcher,
            finish.preferred,
            finish.eos,
            args.limit,
            finish.hints,
            finish.marks,
            finish.keys,
            **extra,
        )
        print(f"| {name} | {'none' if path is None else len(path)} | {time.perf_counter() - t0:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
