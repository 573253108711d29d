"""Interactive latency beside a running batch: TTFT of streamed /v1/completions requests, alone and while a
/v1/batches batch of --lines lines runs (at the lowest priority, --batch-max-in-flight lines at once).

    python -m bench.batch [--lines 200] [--requests 10] [--rounds 3] [--in-flight 4] [--policy priority|fcfs]

Starts the real server (bench.admission's random-weight Qwen2-shaped checkpoint) on a fresh --batch-dir. Each of
--rounds rounds: phase `idle`, --requests interactive requests one after another (a 64-token prompt, 16 tokens
out), TTFT each; then a batch is created (each line a 64-token prompt, 64 tokens out, ignore_eos) and, once it is in
progress, phase `batch`: the same interactive requests; then the batch is cancelled. The phases alternate so that a
machine whose load drifts weighs on both alike; the report pools each phase over the rounds and gives each round's
p50 ratio, and how many batch lines were answered during the batch phases.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from bench.admission import build_checkpoint, pct
from tests.e2e.conftest import start_server


def ttft(client: httpx.Client, prompt: list[int]) -> float:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "stream": True, "ignore_eos": True}
    t0 = time.perf_counter()
    with client.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        for raw in lines:
            if raw.startswith("data: {") and json.loads(raw[6:])["choices"][0]["text"]:
                first = time.perf_counter() - t0
                for _rest in lines:  # the rest of the stream, so that the next request starts alone
                    pass
                return first
    raise RuntimeError("no token streamed")


def phase(client: httpx.Client, rng: random.Random, n: int) -> list[float]:
    return [ttft(client, [rng.randrange(1000, 100_000) for _ in range(64)]) for _ in range(n)]


def start_batch(client: httpx.Client, rng: random.Random, lines: int) -> str:
    text = "\n".join(
        json.dumps(
            {
                "custom_id": f"b{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {
                    "model": "tiny",
                    "prompt": [rng.randrange(1000, 100_000) for _ in range(64)],
                    "max_tokens": 64,
                    "ignore_eos": True,
                },
            }
        )
        for i in range(lines)
    )
    upload = client.post("/v1/files", files={"file": ("in.jsonl", text.encode())}, data={"purpose": "batch"})
    upload.raise_for_status()
    body = {"input_file_id": upload.json()["id"], "endpoint": "/v1/completions", "completion_window": "24h"}
    batch = client.post("/v1/batches", json=body).json()
    deadline = time.monotonic() + 60
    while client.get(f"/v1/batches/{batch['id']}").json()["request_counts"]["completed"] < 1:
        if time.monotonic() > deadline:
            raise RuntimeError("the batch did not start")
        time.sleep(0.05)
    return str(batch["id"])


def report(name: str, xs: list[float]) -> None:
    ms = [x * 1000 for x in xs]
    print(f"{name:<8} TTFT ms  p50 {statistics.median(ms):7.1f}  p90 {pct(ms, 90):7.1f}  max {max(ms):7.1f}")


def cancel(client: httpx.Client, batch_id: str) -> int:
    """Cancel the batch and wait until it stopped: the lines it answered."""
    client.post(f"/v1/batches/{batch_id}/cancel").raise_for_status()
    deadline = time.monotonic() + 120
    while (batch := client.get(f"/v1/batches/{batch_id}").json())["status"] != "cancelled":
        if time.monotonic() > deadline:
            raise RuntimeError("the batch did not stop")
        time.sleep(0.05)
    return int(batch["request_counts"]["completed"])


def rounds(client: httpx.Client, rng: random.Random, args: argparse.Namespace) -> None:
    idle: list[float] = []
    busy: list[float] = []
    answered = 0
    for r in range(args.rounds):
        alone = phase(client, rng, args.requests)
        batch_id = start_batch(client, rng, args.lines)
        before = client.get(f"/v1/batches/{batch_id}").json()["request_counts"]["completed"]
        beside = phase(client, rng, args.requests)
        answered += cancel(client, batch_id) - before
        ratio = statistics.median(beside) / statistics.median(alone)
        print(f"round {r + 1}: p50 idle {statistics.median(alone) * 1000:.1f} ms, batch x{ratio:.2f}", flush=True)
        idle += alone
        busy += beside
    report("idle", idle)
    report("batch", busy)
    print(f"p50 ratio x{statistics.median(busy) / statistics.median(idle):.2f}; {answered} batch lines answered")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lines", type=int, default=200)
    ap.add_argument("--requests", type=int, default=10, help="interactive requests per phase and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--in-flight", type=int, default=4)
    ap.add_argument("--policy", default="priority", choices=("priority", "fcfs"))
    args = ap.parse_args()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        flags = ["--batch-dir", str(root / "batches"), "--batch-max-in-flight", str(args.in_flight)]
        server = start_server(build_checkpoint(root), root, *flags, "--scheduling-policy", args.policy)
        try:
            with httpx.Client(base_url=server.url, timeout=300) as client:
                phase(client, rng, 3)  # warm-up
                rounds(client, rng, args)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
