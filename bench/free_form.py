"""Free-form constraints on a served model: how many answers end "stop" and validate.

    python -m server --port 8000 &
    python -m bench.free_form --url http://127.0.0.1:8000 --max-tokens 200

24 requests each (greedy and temperature 1, seeds 0..23) for: an object with an unbounded string, one with
strings and an integer, any object, and the regex [a-z]+@[a-z]+\\.com. On a random-weight model nothing here
ends unless the engine finishes it within max_tokens (engine/structured/forced_finish.py).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import re
import time
from typing import Any

import httpx
import jsonschema

CASES: dict[str, Any] = {
    "string": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
    "person": {
        "type": "object",
        "required": ["name", "age", "bio"],
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "bio": {"type": "string"}},
    },
    "object": {"type": "object"},
}
REGEX = r"[a-z]+@[a-z]+\.com"


def one(url: str, model: str, kind: str, i: int, max_tokens: int) -> tuple[str, str, bool, int]:
    common = {"model": model, "max_tokens": max_tokens, "temperature": 0.0 if i % 2 == 0 else 1.0, "seed": i}
    if kind == "regex":
        r = httpx.post(
            f"{url}/v1/completions",
            timeout=600,
            json={**common, "prompt": "Mail:", "structured_outputs": {"regex": REGEX}},
        ).json()
        choice, text = r["choices"][0], r["choices"][0]["text"]
        ok = re.fullmatch(REGEX, text) is not None
    else:
        r = httpx.post(
            f"{url}/v1/chat/completions",
            timeout=600,
            json={
                **common,
                "messages": [{"role": "user", "content": "Give me a person as JSON."}],
                "response_format": {"type": "json_schema", "json_schema": {"name": kind, "schema": CASES[kind]}},
            },
        ).json()
        choice, text = r["choices"][0], r["choices"][0]["message"]["content"]
        try:
            jsonschema.validate(json.loads(text), CASES[kind])
            ok = True
        except (ValueError, jsonschema.ValidationError):
            ok = False
    return kind, choice["finish_reason"], ok, r["usage"]["completion_tokens"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--requests", type=int, default=24)
    args = ap.parse_args()
    model = httpx.get(f"{args.url}/v1/models", timeout=30).json()["data"][0]["id"]
    kinds = [*CASES, "regex"]
    t0 = time.time()
    with cf.ThreadPoolExecutor(8) as ex:
        results = list(
            ex.map(
                lambda a: one(args.url, model, *a, args.max_tokens),
                [(k, i) for k in kinds for i in range(args.requests)],
            )
        )
    for k in kinds:
        rs = [r for r in results if r[0] == k]
        print(
            f"{k:>7}: stop {sum(r[1] == 'stop' for r in rs)}/{len(rs)}, valid {sum(r[2] for r in rs)}/{len(rs)}, "
            f"completion tokens max {max(r[3] for r in rs)} mean {sum(r[3] for r in rs) / len(rs):.1f}"
        )
    print(f"max_tokens {args.max_tokens}, {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
