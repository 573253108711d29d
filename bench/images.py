"""Images (a Qwen2-VL checkpoint): images per second through the image worker, and TTFT of an image request with
a cold and a warm cache, on the vision demo (`spindle make-demo --vision PATH`).

    python -m bench.images [--model DIR] [--size 448] [--images 16] [--requests 5] [--port 8431]

1. preprocess: --images distinct --size x --size PNGs through the image worker process
(server/multimodal/image_worker.py,
   one process, its processor cache off), one request each, then the same ones again with the cache on (hits).
2. ttft: a real server (`python -m server --model DIR`); per round a new image (cold: the processor cache, the
   engine's encoder cache and its prefix cache all miss), then the same image again (warm: only the hash crosses
   the pipe, the encoder output and the prompt's KV blocks are cached), streamed, max_tokens 1; the medians of
   --requests rounds. A text-only request of the same text is the floor.
"""

from __future__ import annotations

import argparse
import base64
import io
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import anyio
import httpx
import numpy as np
from PIL import Image


def png(seed: int, size: int) -> bytes:
    rng = np.random.RandomState(seed)
    # smooth-ish content (a gradient plus noise) compresses like a photo, not like white noise
    base = np.linspace(0, 255, size * size * 3).reshape(size, size, 3)
    pixels = np.clip(base + rng.randint(-40, 40, (size, size, 3)), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


async def preprocess(model: str, size: int, n: int) -> None:
    from server.multimodal.images import image_support, open_image_worker

    support = image_support(model)
    assert support is not None, f"{model} is not a Qwen2-VL checkpoint"
    blobs = [png(i, size) for i in range(n)]
    for label, cache in (("cache off", 0), ("cache on, second pass", 1 << 30)):
        async with open_image_worker(support, cache) as pool:
            await pool.call(["process", [png(10_000, size)], None, None])  # warm the worker's imports
            if cache:
                for b in blobs:
                    await pool.call(["process", [b], None, None])
            t0 = time.perf_counter()
            out = [await pool.call(["process", [b], None, None]) for b in blobs]
            dt = time.perf_counter() - t0
        grid = out[0][0][2]
        print(
            f"preprocess {size}x{size} ({label}): {n / dt:7.1f} images/s ({dt / n * 1e3:6.1f} ms each; "
            f"grid {grid}, {len(out[0][0][0]) / 1e6:.1f} MB of pixels)"
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ttft(client: httpx.Client, url: str, content: Any) -> float:
    body = {
        "model": "m",
        "max_tokens": 1,
        "temperature": 0,
        "stream": True,
        "messages": [{"role": "user", "content": content}],
    }
    t0 = time.perf_counter()
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                return time.perf_counter() - t0
            if line.startswith("data: ") and '"finish_reason":"' in line:
                return time.perf_counter() - t0
    raise RuntimeError("the stream ended without a token")


def serve_ttft(model: str, size: int, rounds: int, port: int) -> None:
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "server", "--model", model, "--port", str(port), "--served-model-name", "m"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        with httpx.Client(timeout=120) as client:
            deadline = time.time() + 300
            while True:
                try:
                    if client.get(f"{url}/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.time() > deadline or proc.poll() is not None:
                    raise RuntimeError("the server did not start")
                time.sleep(0.5)
            text = {"type": "text", "text": "What is in the picture?"}

            def part(i: int) -> dict[str, Any]:
                data = base64.b64encode(png(1000 + i, size)).decode()
                return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}

            ttft(client, url, [part(-1), text])  # warm-up: the first request's one-off costs
            cold, warm, plain = [], [], []
            for i in range(rounds):
                cold.append(ttft(client, url, [part(i), text]))
                warm.append(ttft(client, url, [part(i), text]))
                plain.append(ttft(client, url, text["text"]))
            metrics = client.get(f"{url}/metrics").text

        def ms(xs: list[float]) -> float:
            return statistics.median(xs) * 1e3

        print(
            f"ttft {size}x{size}, median of {rounds}: cold {ms(cold):7.1f} ms, warm {ms(warm):7.1f} ms, "
            f"text only {ms(plain):7.1f} ms"
        )
        for line in metrics.splitlines():
            if line.startswith("spindle_mm_") and "_total{" in line:
                print("  " + line)
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="a Qwen2-VL checkpoint (default: a fresh vision demo)")
    ap.add_argument("--size", type=int, default=448, help="image side in pixels")
    ap.add_argument("--images", type=int, default=16)
    ap.add_argument("--requests", type=int, default=5, help="TTFT rounds (cold then warm)")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--skip-ttft", action="store_true")
    args = ap.parse_args()
    if args.model is None:
        from demo.checkpoints import make_vision_demo

        args.model = str(make_vision_demo(os.path.join(tempfile.gettempdir(), "spindle-vision-demo")))
    print(f"model {args.model}, {os.cpu_count()} CPUs")
    anyio.run(preprocess, args.model, args.size, args.images, backend="trio")
    if not args.skip_ttft:
        serve_ttft(args.model, args.size, args.requests, args.port or free_port())


if __name__ == "__main__":
    main()
