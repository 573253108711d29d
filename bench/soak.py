"""Soak: mixed, partly hostile traffic against a running server for N minutes; watch memory and leftovers.

    python -m bench.soak --url http://127.0.0.1:8000 --server-pid PID [--minutes 10] [--concurrency 16]

Traffic (chosen at random per request): streams, non-streams, n > 1, stop strings, clients that
disconnect mid-stream, bodies that must be refused (400), and big prompts. Every 30 s it prints the
RSS of the server and of the engine (the server's child named `engine`) with the least-squares slope
so far; at the end, errors by kind and what the engine still holds (running, waiting, KV usage).
A 5xx for a valid request, or anything left running, is a failure (exit 1).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import time
from collections import Counter

import anyio
import httpx

BAD_BODIES: list[object] = [
    {"model": "m", "prompt": "x", "max_tokens": -1},
    {"model": "m", "prompt": "x", "temperature": "hot"},
    {"model": "m", "prompt": "x", "n": 0},
    {"model": "m", "messages": "not a list"},
    {"model": "m", "prompt": "x", "top_k": 2**64},
    [1, 2, 3],
]


def rss_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def engine_pid(server_pid: int) -> int | None:
    out = subprocess.run(["pgrep", "-P", str(server_pid), "-f", "engine"], capture_output=True, text=True).stdout
    return int(out.split()[0]) if out.split() else None


def slope_kib_per_min(points: list[tuple[float, int]]) -> float:
    if len(points) < 2:
        return 0.0
    n = len(points)
    mx = sum(t for t, _ in points) / n
    my = sum(v for _, v in points) / n
    var = sum((t - mx) ** 2 for t, _ in points)
    return 60 * sum((t - mx) * (v - my) for t, v in points) / var if var else 0.0


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


class Soak:
    def __init__(self, url: str, model: str, rng: random.Random) -> None:
        self.url = url
        self.model = model
        self.rng = rng
        self.outcomes: Counter[str] = Counter()

    async def one(self, client: httpx.AsyncClient) -> None:
        kind = self.rng.choice(["stream", "plain", "n", "stop", "disconnect", "bad", "big"])
        m, rng = self.model, self.rng
        body: object = {"model": m, "prompt": "soak " * rng.randint(1, 50), "max_tokens": rng.randint(1, 64)}
        assert isinstance(body, dict)
        if kind == "bad":
            body = rng.choice(BAD_BODIES)
            if isinstance(body, dict):
                body = {**body, "model": m}
        elif kind == "n":
            body.update(n=rng.randint(2, 4), temperature=0.8)
        elif kind == "stop":
            body.update(stop=["a", "the"], max_tokens=64)
        elif kind == "big":
            body.update(prompt=[rng.randrange(100, 100_000) for _ in range(rng.randint(500, 1500))], max_tokens=4)
        path = "/v1/completions"
        try:
            if kind in ("stream", "disconnect"):
                body.update(stream=True)
                async with client.stream("POST", path, json=body) as r:
                    self.outcomes[f"{kind} {r.status_code}"] += 1
                    async for _ in r.aiter_lines():
                        if kind == "disconnect" and rng.random() < 0.2:
                            break  # leaves mid-stream: the server must abort it
            else:
                r = await client.post(path, json=body)
                self.outcomes[f"{kind} {r.status_code}"] += 1
        except httpx.HTTPError as e:
            self.outcomes[f"{kind} {type(e).__name__}"] += 1


async def main_async(args: argparse.Namespace) -> int:
    soak = Soak(args.url, args.model, random.Random(args.seed))
    engine = engine_pid(args.server_pid)
    points: dict[str, list[tuple[float, int]]] = {"server": [], "engine": []}
    t0 = time.monotonic()
    end = t0 + args.minutes * 60
    async with httpx.AsyncClient(
        base_url=args.url, timeout=120, limits=httpx.Limits(max_connections=args.concurrency + 4)
    ) as client:
        if args.model is None:
            soak.model = (await client.get("/v1/models")).json()["data"][0]["id"]

        async def worker() -> None:
            while time.monotonic() < end:
                await soak.one(client)

        async def report() -> None:
            while True:
                now = time.monotonic() - t0
                for name, pid in (("server", args.server_pid), ("engine", engine)):
                    if pid is not None:
                        points[name].append((now, rss_kib(pid)))
                print(
                    f"t={now:6.0f}s  server RSS {points['server'][-1][1] / 1024:7.1f} MiB "
                    f"(slope {slope_kib_per_min(points['server']):+7.1f} KiB/min)  "
                    + (
                        f"engine RSS {points['engine'][-1][1] / 1024:7.1f} MiB "
                        f"(slope {slope_kib_per_min(points['engine']):+7.1f} KiB/min)"
                        if engine
                        else ""
                    ),
                    flush=True,
                )
                await anyio.sleep(30)

        async with anyio.create_task_group() as tg:
            tg.start_soon(report)
            async with anyio.create_task_group() as workers:
                for _ in range(args.concurrency):
                    workers.start_soon(worker)
            tg.cancel_scope.cancel()
        for _ in range(100):  # the engine reports its gauges with its next frame
            text = (await client.get("/metrics")).text
            left = {
                n: metric(text, n)
                for n in ("spindle_num_requests_running", "spindle_num_requests_waiting", "spindle_kv_cache_usage_perc")
            }
            if not any(left.values()):
                break
            await anyio.sleep(0.1)
    print("outcomes:")
    for key, count in sorted(soak.outcomes.items()):
        print(f"  {key:32s} {count}")
    print("left in the engine:", json.dumps(left))
    server_5xx = sum(c for k, c in soak.outcomes.items() if k.split()[0] != "bad" and k.split()[-1].startswith("5"))
    bad_not_4xx = sum(c for k, c in soak.outcomes.items() if k.startswith("bad ") and not k.split()[-1].startswith("4"))
    print(f"5xx for valid requests: {server_5xx}; bad bodies not refused with 4xx: {bad_not_4xx}")
    return 1 if server_5xx or bad_not_4xx or any(left.values()) else 0


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.soak")
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--server-pid", type=int, required=True)
    parser.add_argument("--model", default=None, help="default: the first of /v1/models")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    raise SystemExit(anyio.run(main_async, parser.parse_args(), backend="trio"))


if __name__ == "__main__":
    main()
