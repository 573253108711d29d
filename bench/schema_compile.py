"""What the server's structured-output path makes of a corpus's schemas without a model: per source, accepted,
relaxed (and which keywords), refused (and why), and refused up front for max_tokens (answer_budget's lower bound
over the tokenizer's vocabulary), each schema compiled as a `response_format` `json_schema` without `strict` is.

    python -m bench.schema_compile --corpus jsonschemabench --sample 8 --offset 0 --tokenizer TOKENIZER_JSON

Minutes for a JSONSchemaBench sample of ~1,200 on 2 cores; no server, no model weights.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import tokenizers

from bench.schema_coverage import CORPUS, corpus
from engine.messages import StructuredOutputs
from engine.structured.answer_floor import min_answer_tokens
from engine.structured.grammar import json_style
from engine.structured.relaxed_schema import relax
from server.structured.answer_budget import vocabulary
from server.structured.constraint import one_of_refusal

MAX_BYTES = 256 * 1024  # the server's default --max-structured-output-size


def judge(schema: Any, tokenizer: Any, max_tokens: int) -> tuple[str, str]:
    """(outcome, detail) of one schema: "accepted" or "relaxed" (its keywords), "refused" (why), "size", "budget"."""
    spec = json.dumps(schema)
    if not isinstance(schema, dict):
        return ("accepted", "") if schema is not False else ("refused", "the schema false allows nothing")
    if len(spec.encode()) > MAX_BYTES:
        return "size", f"{len(spec.encode())} bytes"
    try:
        out = relax(schema, json_style(StructuredOutputs("json", spec)))
    except Exception as e:  # what the server answers with a 400 naming the schema
        return "refused", (str(e).strip() or type(e).__name__).split("\n")[0][:100]
    vocab = vocabulary(tokenizer)
    floor = 0 if vocab is None else min_answer_tokens(out.schema, vocab)
    if floor > max_tokens:
        return "budget", f"{floor} tokens"
    keywords = out.keywords
    refusal = one_of_refusal(out.schema) if "oneOf" in keywords else None
    if refusal is not None:  # the server refuses a oneOf it reads as anyOf whose branches may overlap
        return "refused", refusal[:100]
    keywords = tuple(k for k in keywords if k != "oneOf")
    return ("relaxed", ",".join(keywords)) if keywords else ("accepted", "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", choices=("local", "jsonschemabench"), default="local")
    ap.add_argument("--sample", type=int, default=8, help="jsonschemabench: every K-th schema of each category")
    ap.add_argument("--offset", type=int, default=0, help="jsonschemabench: from this index of each category")
    ap.add_argument("--tokenizer", type=Path, required=True, help="the served model's tokenizer.json")
    ap.add_argument("--max-tokens", type=int, default=384)
    args = ap.parse_args()
    if args.corpus == "local":
        items = [item for _, item in corpus(CORPUS, None)]
    else:
        from bench import jsonschemabench  # why late: only this corpus needs the cache

        items = jsonschemabench.sample(jsonschemabench.data_dir(), args.sample, args.offset)
    tokenizer = tokenizers.Tokenizer.from_file(str(args.tokenizer))
    rows: dict[str, Counter[str]] = defaultdict(Counter)
    for source, name, schema in items:
        outcome, detail = judge(schema, tokenizer, args.max_tokens)
        for key in (source, "total"):
            rows[key][outcome] += 1
        if outcome not in ("accepted", "relaxed"):
            print(f"{outcome}: {source}/{name}: {detail}", file=sys.stderr)
    cols = ("accepted", "relaxed", "refused", "size", "budget")
    print("| source | schemas | " + " | ".join(cols) + " | compiled |\n|---|" + "---:|" * (len(cols) + 2))
    for key in sorted(rows, key=lambda k: (k == "total", k)):
        c, n = rows[key], sum(rows[key].values())
        ok = c["accepted"] + c["relaxed"]
        print(f"| {key} | {n} | " + " | ".join(str(c[k]) for k in cols) + f" | {ok} ({100 * ok / n:.1f}%) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
