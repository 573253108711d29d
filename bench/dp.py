"""Data parallel: prefix affinity against round robin on a shared-prefix workload, in one run.

    python -m bench.dp [--engines 2] [--prefixes 8] [--prefix-len 1000] [--requests 400]
        [--concurrency 16] [--num-blocks 320] [--model PATH]

Starts `python -m server --data-parallel-size N` once per policy (affinity, then round_robin), each with
the same workload: `--prefixes` system prompts of `--prefix-len` token ids, each request one of them
(shuffled, fixed seed) plus 16 ids of its own, 4 output tokens. `--num-blocks` is per engine: the default
holds about half the prefixes, so which engine a prefix goes to decides whether it stays cached.
Prefix-cache hit rate from the engines' own counters (spindle_prefix_cache_hits / _queries, tokens) over
the run; throughput in requests and prompt tokens per second, wall clock from first send to last reply.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import time

import anyio
import httpx


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def per_engine(url: str, name: str, engines: int) -> list[float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return [
        sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(name + "{") and f'engine="{i}"' in line
        )
        for i in range(engines)
    ]


def workload(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(0)
    prefixes = [[rng.randrange(1000, 30000) for _ in range(args.prefix_len)] for _ in range(args.prefixes)]
    prompts = [
        prefixes[i % args.prefixes] + [rng.randrange(1000, 30000) for _ in range(16)] for i in range(args.requests)
    ]
    rng.shuffle(prompts)
    return prompts


async def drive(url: str, prompts: list[list[int]], concurrency: int) -> tuple[float, int]:
    failures = 0
    queue = list(reversed(prompts))
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:

        async def worker() -> None:
            nonlocal failures
            while queue:
                prompt = queue.pop()
                r = await client.post(
                    "/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
                )
                failures += r.status_code != 200

        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for _ in range(concurrency):
                tg.start_soon(worker)
        return time.perf_counter() - t0, failures


def run_policy(args: argparse.Namespace, policy: str, prompts: list[list[int]]) -> dict[str, float]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "server",
        "--port",
        str(port),
        "--data-parallel-size",
        str(args.engines),
        "--data-parallel-policy",
        policy,
        "--num-blocks",
        str(args.num_blocks),
        "--log-level",
        "warning",
    ]
    if args.model:
        cmd += ["--model", args.model]
    proc = subprocess.Popen(cmd)
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"server did not start (exit {proc.returncode})")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        q0, h0 = metric(url, "spindle_prefix_cache_queries_total"), metric(url, "spindle_prefix_cache_hits_total")
        wall, failures = anyio.run(drive, url, prompts, args.concurrency)
        time.sleep(0.2)  # the last frames' stats
        q1, h1 = metric(url, "spindle_prefix_cache_queries_total"), metric(url, "spindle_prefix_cache_hits_total")
        routed = per_engine(url, "spindle_engine_requests_routed_total", args.engines)
        prompt_tokens = sum(len(p) for p in prompts)
        return {
            "hit_rate": (h1 - h0) / max(q1 - q0, 1),
            "req_s": len(prompts) / wall,
            "prompt_tok_s": prompt_tokens / wall,
            "wall_s": wall,
            "failures": failures,
            "routed": routed,
        }  # type: ignore[dict-item]
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--prefixes", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=1000)
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=320)
    p.add_argument("--model", default=None)
    p.add_argument("--policies", default="affinity,round_robin")
    args = p.parse_args()
    prompts = workload(args)
    print(
        f"{args.engines} engines, {args.prefixes} prefixes x {args.prefix_len} tokens, {args.requests} requests, "
        f"concurrency {args.concurrency}, {args.num_blocks} blocks per engine"
    )
    for policy in args.policies.split(","):
        r = run_policy(args, policy, prompts)
        print(
            f"{policy:12s} hit rate {r['hit_rate']:.3f}  {r['req_s']:.1f} req/s  {r['prompt_tok_s']:.0f} prompt tok/s"
            f"  wall {r['wall_s']:.1f} s  routed {r['routed']}  failures {r['failures']}",
            flush=True,
        )


if __name__ == "__main__":
    main()
