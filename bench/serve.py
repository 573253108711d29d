"""Load generator for an OpenAI-compatible server, with `vllm bench serve`'s definitions.

    python -m bench.serve --url http://127.0.0.1:8000 [--num-prompts 200] [--concurrency 64]
        [--input-len 128] [--output-len 128] [--server-pid PID]

TTFT: request start to the first content chunk. TPOT: (E2E - TTFT) / (output tokens - 1).
ITL: the gaps between successive content chunks. With --server-pid: that process's CPU time
(user + sys, from /proc) over the run divided by the output tokens.

Against a server whose engine is the fake of bench/fake_engine_process.py (SPINDLE_ENGINE_COMMAND, no model:
the API alone is measured); `python -m bench.api_scaling` does that for `--api-server-count` 1, 2, 4 with a
cheaper raw-socket client, and sums the CPU of every API process (--server-pid names only one).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from dataclasses import dataclass, field

import anyio
import httpx


@dataclass
class Result:
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    ok: bool = False


def cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


async def one(client: httpx.AsyncClient, model: str, prompt: list[int], out_len: int) -> Result:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": out_len,
        "ignore_eos": True,
        "stream": True,
        "temperature": 0,
        "stream_options": {"include_usage": True},
    }
    res = Result()
    t0 = last = time.perf_counter()
    buf = ""
    async with client.stream("POST", "/v1/completions", json=body) as r:
        async for text in r.aiter_text():
            buf += text
            while "\n\n" in buf:
                raw, buf = buf.split("\n\n", 1)
                if not raw.startswith("data: ") or raw == "data: [DONE]":
                    continue
                ev = json.loads(raw[6:])
                now = time.perf_counter()
                if ev.get("usage") and not ev.get("choices"):
                    res.output_tokens = ev["usage"]["completion_tokens"]
                    continue
                if ev.get("choices") and ev["choices"][0].get("text"):
                    if not res.ttft:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
    res.e2e = time.perf_counter() - t0
    res.ok = res.output_tokens > 0
    return res


async def run(args: argparse.Namespace) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 50000) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    results: list[Result] = []
    limiter = anyio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(
        base_url=args.url, timeout=600, limits=httpx.Limits(max_connections=args.concurrency + 8)
    ) as client:
        models = (await client.get("/v1/models")).json()
        model = args.model or models["data"][0]["id"]

        async def worker(p: list[int]) -> None:
            async with limiter:
                results.append(await one(client, model, p, args.output_len))

        cpu0 = cpu_seconds(args.server_pid) if args.server_pid else 0.0
        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for p in prompts:
                tg.start_soon(worker, p)
        dur = time.perf_counter() - t0
        cpu1 = cpu_seconds(args.server_pid) if args.server_pid else 0.0
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    ms = 1000.0
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [x for r in ok for x in r.itl]
    print("============ Serving Benchmark Result ============")
    print(f"Successful requests: {len(ok)}")
    print(f"Benchmark duration (s): {dur:.2f}")
    print(f"Request throughput (req/s): {len(ok) / dur:.2f}")
    print(f"Output token throughput (tok/s): {out_tokens / dur:.2f}")
    for name, xs in (("TTFT", [r.ttft for r in ok]), ("TPOT", tpot), ("ITL", itl), ("E2E", [r.e2e for r in ok])):
        print(f"Mean {name} (ms): {statistics.fmean(xs) * ms if xs else float('nan'):.2f}")
        print(f"Median {name} (ms): {pct(xs, 50) * ms:.2f}")
        print(f"P99 {name} (ms): {pct(xs, 99) * ms:.2f}")
    if args.server_pid:
        print(f"api_cpu_us_per_token: {(cpu1 - cpu0) / max(out_tokens, 1) * 1e6:.1f}")
    print("==================================================")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--server-pid", type=int, default=0)
    anyio.run(run, ap.parse_args())


if __name__ == "__main__":
    main()
