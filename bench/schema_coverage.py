"""How a running server handles real-world JSON schemas: each schema of bench/schemas/ sent once as
response_format json_schema; per source: accepted, valid + stop, relaxed, refused, and what went wrong.

    python -m bench.schema_coverage URL [--concurrency 4] [--max-tokens 384] [--strict] [--source S] [--name N]
    python -m bench.schema_coverage URL --corpus jsonschemabench --sample 8 --offset 0 [--temperature 0]

`--corpus jsonschemabench` runs JSONSchemaBench (bench/jsonschemabench.py) instead: every `--sample`-th schema of
each category from `--offset`, its categories as sources.

"valid + stop" is finish_reason "stop" with content that validates against the whole schema (jsonschema, formats
checked where jsonschema can), as a share of all schemas and of those the judge can read ("unjudged": answers
jsonschema cannot check, e.g. a $ref to a document outside the schema). "relaxed" counts answers whose
X-Structured-Output-Relaxed header names what the
server could not enforce; "invalid" splits by relaxed or not (a non-relaxed invalid output is a bug). Bounded: one
request per schema, `--concurrency` at once, `--timeout` seconds each.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.judge import check

CORPUS = Path(__file__).resolve().parent / "schemas"
RELAXED_HEADER = "x-structured-output-relaxed"
COLUMNS = (
    "schemas",
    "accepted",
    "valid+stop",
    "relaxed",
    "refused",
    "invalid(relaxed)",
    "invalid(strict)",
    "length",
    "unjudged",
    "5xx",
)


@dataclass
class Result:
    source: str
    name: str
    outcome: str  # "valid" | "invalid" | "length" | "refused" | "5xx" | "unverifiable"
    relaxed: str = ""
    detail: str = ""
    seconds: float = 0.0


def corpus(
    root: Path, only: list[str] | None, names: list[str] | None = None
) -> list[tuple[int, tuple[str, str, Any]]]:
    """(seed, (source, name, schema)) of the schemas asked for; the seed is the schema's place in the whole corpus,
    so a run of a few draws what a run of all drew for them."""
    found = []
    for seed, path in enumerate(sorted(root.glob("*/*.json"))):
        source = path.parent.name
        if (only and source not in only) or (names and path.stem not in names):
            continue
        found.append((seed, (source, path.stem, json.loads(path.read_text()))))
    return found


def selected(args: argparse.Namespace) -> list[tuple[int, tuple[str, str, Any]]]:
    """(seed, item) of the schemas the flags name: the local corpus, or a JSONSchemaBench sample seeded by place."""
    if args.corpus == "local":
        return corpus(CORPUS, args.source, args.name)
    from bench import jsonschemabench  # why late: only this corpus needs the cache

    items = jsonschemabench.sample(jsonschemabench.data_dir(), args.sample, args.offset, args.source)
    return [(i, item) for i, item in enumerate(items) if not args.name or item[1] in args.name]


def run_one(
    client: httpx.Client, url: str, model: str, item: tuple[str, str, Any], args: argparse.Namespace, seed: int
) -> Result:
    source, name, schema = item
    fmt: dict[str, Any] = {"name": name[:64], "schema": schema}
    if args.strict:
        fmt["strict"] = True
    body = {
        "model": model,
        "max_tokens": args.max_tokens,
        "seed": seed,
        "temperature": args.temperature,
        "messages": [{"role": "user", "content": f"Write a JSON value for the schema {name}."}],
        "response_format": {"type": "json_schema", "json_schema": fmt},
    }
    t0 = time.perf_counter()
    try:
        r = client.post(f"{url}/v1/chat/completions", json=body, timeout=args.timeout)
    except httpx.HTTPError as e:
        return Result(source, name, "5xx", detail=f"transport: {type(e).__name__}", seconds=time.perf_counter() - t0)
    took = time.perf_counter() - t0
    relaxed = r.headers.get(RELAXED_HEADER, "")
    if r.status_code == 400:
        return Result(source, name, "refused", relaxed, r.json()["error"]["message"][:160], took)
    if r.status_code != 200:
        return Result(source, name, "5xx", relaxed, f"{r.status_code}: {r.text[:160]}", took)
    choice = r.json()["choices"][0]
    if choice["finish_reason"] != "stop":
        return Result(source, name, "length", relaxed, choice["finish_reason"], took)
    try:
        error = check(schema, choice["message"]["content"] or "")
    except Exception as e:  # the judge cannot read the schema (a remote $ref, a regex Python lacks)
        return Result(source, name, "unverifiable", relaxed, f"{type(e).__name__}: {str(e)[:120]}", took)
    return Result(source, name, "valid" if error is None else "invalid", relaxed, error or "", took)


def table(results: list[Result]) -> str:
    rows: dict[str, Counter[str]] = defaultdict(Counter)
    for res in results:
        for key in (res.source, "total"):
            c = rows[key]
            c["schemas"] += 1
            c["accepted"] += res.outcome not in ("refused", "5xx")
            c["valid+stop"] += res.outcome == "valid"
            c["relaxed"] += bool(res.relaxed) and res.outcome != "refused"
            c["refused"] += res.outcome == "refused"
            c["invalid(relaxed)"] += res.outcome == "invalid" and bool(res.relaxed)
            c["invalid(strict)"] += res.outcome == "invalid" and not res.relaxed
            c["length"] += res.outcome == "length"
            c["unjudged"] += res.outcome == "unverifiable"
            c["5xx"] += res.outcome == "5xx"
    lines = ["| source | " + " | ".join(COLUMNS) + " |", "|---|" + "---:|" * len(COLUMNS)]
    for key in sorted(rows, key=lambda k: (k == "total", k)):
        c = rows[key]
        cells = [str(c[col]) for col in COLUMNS]
        judged = c["schemas"] - c["unjudged"]
        cells[2] += (
            f" ({100 * c['valid+stop'] / max(1, c['schemas']):.1f}%; {100 * c['valid+stop'] / max(1, judged):.1f}%)"
        )
        name = f"**{key}**" if key == "total" else key
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def causes(results: list[Result]) -> str:
    """What was refused, relaxed or invalid, by cause (most frequent first)."""
    out = []
    refused = Counter(r.detail.split(":")[-1].strip()[:90] or r.detail[:90] for r in results if r.outcome == "refused")
    relaxed = Counter(k.strip() for r in results if r.outcome != "refused" for k in r.relaxed.split(",") if k.strip())
    invalid = Counter(r.detail.split(":")[0] for r in results if r.outcome in ("invalid", "unverifiable"))
    for title, counter in (("refused", refused), ("relaxed", relaxed), ("invalid", invalid)):
        if counter:
            out.append(f"{title}: " + "; ".join(f"{n} x {k}" for k, n in counter.most_common(12)))
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("url", help="the server, e.g. http://127.0.0.1:8000")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=384)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    ap.add_argument("--strict", action="store_true", help="send json_schema.strict: true")
    ap.add_argument("--source", action="append", help="only this source (repeatable)")
    ap.add_argument("--name", action="append", help="only the schema of this file name, no .json (repeatable)")
    ap.add_argument("--limit", type=int, default=0, help="at most this many schemas (0: all)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument(
        "--corpus", choices=("local", "jsonschemabench"), default="local", help="bench/schemas or JSONSchemaBench"
    )
    ap.add_argument("--sample", type=int, default=8, help="jsonschemabench: every K-th schema of each category")
    ap.add_argument("--offset", type=int, default=0, help="jsonschemabench: from this index of each category")
    ap.add_argument("--details", type=Path, help="write one JSON line per schema here")
    ap.add_argument(
        "--tables-from",
        type=Path,
        nargs="+",
        help="print the tables of earlier --details files "
        "(later files replace earlier results of the same schema) instead of running",
    )
    args = ap.parse_args()
    if args.tables_from:
        merged = {}
        for path in args.tables_from:
            for line in path.read_text().splitlines():
                res = Result(**json.loads(line))
                merged[(res.source, res.name)] = res
        present = {(p.parent.name, p.stem) for p in CORPUS.glob("*/*.json")}
        local = args.corpus == "local"  # why: a schema since dropped from bench/schemas leaves the table
        results = [r for key, r in sorted(merged.items()) if key in present or not local]
        print(table(results))
        print(causes(results))
        return 0
    url = args.url.rstrip("/")
    items = selected(args)
    if args.limit:
        items = items[: args.limit]
    with httpx.Client() as client:
        model = client.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        t0 = time.perf_counter()
        details = (
            args.details.open("w") if args.details else None
        )  # a line per answer as it comes: a cut run keeps them

        def one(p: tuple[int, tuple[str, str, Any]]) -> Result:
            res = run_one(client, url, model, p[1], args, p[0])
            if details is not None:
                details.write(json.dumps(res.__dict__) + "\n")
                details.flush()
            return res

        with ThreadPoolExecutor(args.concurrency) as pool:
            results = list(pool.map(one, items))
        if details is not None:
            details.close()
    took = time.perf_counter() - t0
    print(table(results))
    print(f"\n{len(results)} schemas in {took:.0f} s, concurrency {args.concurrency}, max_tokens {args.max_tokens}")
    print(causes(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
