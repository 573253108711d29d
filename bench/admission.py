"""Admission control under overload: --max-num-queued-tokens keeps TTFT bounded; without it TTFT keeps growing.

    python -m bench.admission [--seconds 20] [--overload 1.4] [--prompt-len 500] [--queue-seconds 2]

1. Start the server (a random-weight Qwen2-shaped checkpoint big enough that prefill dominates; long
   random-id prompts, max_tokens 1, so no prefix-cache hits) and measure its prefill speed (prompt tokens/s
   with 8 requests in flight).
2. Offer `overload` x that many prompt tokens per second (Poisson arrivals) for `seconds`, without a limit.
3. Restart with --max-num-queued-tokens = speed x queue-seconds and offer the same load.
Prints one table: accepted / refused, TTFT of accepted (p50, p99, first and last third of the run),
latency of the 503s.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import httpx

from tests.e2e.conftest import Server, start_server


@dataclass
class Phase:
    name: str
    ttft: list[tuple[float, float]] = field(default_factory=list)  # (sent at, TTFT) of accepted requests
    refused: list[float] = field(default_factory=list)  # seconds to the 503
    other: int = 0
    retry_after_missing: int = 0


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


def build_checkpoint(root: Path) -> Path:
    from demo.checkpoints import write_random_checkpoint

    return write_random_checkpoint(
        root / "ckpt",
        "qwen2",
        hidden_size=256,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        intermediate_size=768,
        vocab_size=151_646,
        tie_word_embeddings=True,
        rope_theta=1_000_000.0,
        max_position_embeddings=2048,
        seed=0,
    )


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 100_000) for _ in range(n)]


async def one(client: httpx.AsyncClient, ids: list[int], phase: Phase, t0: float) -> None:
    sent = time.monotonic()
    body = {"prompt": ids, "max_tokens": 1, "stream": True, "ignore_eos": True}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code == 503:
            phase.refused.append(time.monotonic() - sent)
            phase.retry_after_missing += "retry-after" not in r.headers
            await r.aread()
            return
        if r.status_code != 200:
            phase.other += 1
            await r.aread()
            return
        first = True
        async for line in r.aiter_lines():
            if first and line.startswith("data: {"):
                phase.ttft.append((sent - t0, time.monotonic() - sent))
                first = False


async def measure_speed(url: str, prompt_len: int, seconds: float = 6.0) -> float:
    """Prompt tokens per second with 8 requests in flight (after one warm-up)."""
    rng = random.Random(1)
    done = 0
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        await client.post("/v1/completions", json={"prompt": prompt(rng, prompt_len), "max_tokens": 1})
        start = time.monotonic()

        async def worker() -> None:
            nonlocal done
            while time.monotonic() - start < seconds:
                r = await client.post("/v1/completions", json={"prompt": prompt(rng, prompt_len), "max_tokens": 1})
                r.raise_for_status()
                done += prompt_len

        async with anyio.create_task_group() as tg:
            for _ in range(8):
                tg.start_soon(worker)
        return done / (time.monotonic() - start)


async def offer(url: str, phase: Phase, rate: float, seconds: float, prompt_len: int) -> None:
    """Open loop: Poisson arrivals at `rate` requests/s for `seconds`; waits for every request to end."""
    rng = random.Random(2)
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=2000)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        t0 = time.monotonic()
        async with anyio.create_task_group() as tg:
            at = 0.0
            while at < seconds:
                await anyio.sleep(max(0.0, t0 + at - time.monotonic()))
                tg.start_soon(one, client, prompt(rng, prompt_len), phase, t0)
                at += rng.expovariate(rate)


def row(p: Phase, seconds: float) -> str:
    ttft = [t for _, t in p.ttft]
    early = [t for s, t in p.ttft if s < seconds / 3]
    late = [t for s, t in p.ttft if s >= 2 * seconds / 3]
    ms = [x * 1000 for x in p.refused]
    return (
        f"| {p.name} | {len(p.ttft)} | {len(p.refused)} | {pct(ttft, 50):.2f} | {pct(ttft, 99):.2f} | "
        f"{statistics.fmean(early) if early else float('nan'):.2f} | "
        f"{statistics.fmean(late) if late else float('nan'):.2f} | "
        f"{pct(ms, 50):.1f} / {pct(ms, 99):.1f} / {max(ms, default=float('nan')):.1f} |"
    )


def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        ckpt = build_checkpoint(tmp)
        common = ("--max-model-len", "2048", "--no-enable-prefix-caching", "--sse-keepalive", "0")
        server: Server = start_server(ckpt, tmp, *common)
        try:
            speed = anyio.run(measure_speed, server.url, args.prompt_len)
            rate = args.overload * speed / args.prompt_len
            print(
                f"prefill speed {speed:.0f} prompt tok/s; offering {rate:.2f} req/s x {args.prompt_len} tokens "
                f"= {rate * args.prompt_len:.0f} tok/s for {args.seconds:.0f} s",
                file=sys.stderr,
            )
            unlimited = Phase("no limit")
            anyio.run(offer, server.url, unlimited, rate, args.seconds, args.prompt_len)
        finally:
            server.stop()
        limit = int(speed * args.queue_seconds)
        server = start_server(ckpt, tmp, *common, "--max-num-queued-tokens", str(limit))
        try:
            limited = Phase(f"--max-num-queued-tokens {limit}")
            anyio.run(offer, server.url, limited, rate, args.seconds, args.prompt_len)
        finally:
            server.stop()
    print(
        f"\nprompt {args.prompt_len} tokens, max_tokens 1, {args.overload:.1f}x the measured prefill speed "
        f"({speed:.0f} tok/s), {args.seconds:.0f} s of arrivals\n"
    )
    print(
        "| run | accepted | 503 | TTFT p50 s | TTFT p99 s | TTFT mean, first third s | TTFT mean, last third s "
        "| 503 latency p50 / p99 / max ms |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for p in (unlimited, limited):
        print(row(p, args.seconds))
    if limited.other or unlimited.other or limited.retry_after_missing:
        print(
            f"\nunexpected statuses: {unlimited.other + limited.other}; 503 without Retry-After: "
            f"{limited.retry_after_missing}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--overload", type=float, default=1.4)
    parser.add_argument("--prompt-len", type=int, default=500)
    parser.add_argument("--queue-seconds", type=float, default=2.0)
    run(parser.parse_args())


if __name__ == "__main__":
    main()
