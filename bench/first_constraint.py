"""A running stream's largest inter-token gap when the server's first constrained request arrives.

    python -m server --port 8000 &   # wait until /health answers, and a few seconds more
    python -m bench.first_constraint --url http://127.0.0.1:8000

The grammar backend (llguidance's tokenizer, ~1 s holding the GIL for a 150k vocabulary) is built when the
engine process starts; built by the first constrained request instead, it stalled every running stream once.
"""

from __future__ import annotations

import argparse
import threading
import time

import httpx


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="served model name (default: the server's first)")
    args = ap.parse_args()
    model = args.model or httpx.get(f"{args.url}/v1/models", timeout=30).json()["data"][0]["id"]
    arrivals: list[float] = []

    def stream() -> None:
        body = {"model": model, "prompt": "hi", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{args.url}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    arrivals.append(time.perf_counter())

    t = threading.Thread(target=stream)
    t.start()
    while len(arrivals) < 20:  # the stream is running
        time.sleep(0.01)
    t0 = time.perf_counter()
    r = httpx.post(
        f"{args.url}/v1/chat/completions",
        timeout=120,
        json={
            "model": model,
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 20,
            "response_format": {"type": "json_object"},
        },
    )
    latency = time.perf_counter() - t0
    t.join()
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    print(f"first constrained request: {r.status_code} in {latency * 1000:.0f} ms")
    print(
        f"stream: {len(arrivals)} chunks, largest gap {max(gaps) * 1000:.1f} ms, "
        f"median {sorted(gaps)[len(gaps) // 2] * 1000:.2f} ms"
    )


if __name__ == "__main__":
    main()
