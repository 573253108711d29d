"""`--models-dir`: a model's cold first request (its engine loaded on demand) against a warm one, per model size.

    python -m bench.models [--repeats 3]

Writes random-weight Qwen2-shaped checkpoints (real Qwen2 tokenizer, bfloat16) of a few sizes into one folder, starts
`python -m server --models-dir DIR --max-loaded-models 1`, and for each size, `--repeats` times: a request for the
model when another one is loaded (cold: the other is unloaded, this one loaded, then 8 tokens generated) and the
same request again (warm). Prints the median seconds of each, wall clock at the client.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.dp import free_port

# name -> (hidden, layers, heads, kv heads, intermediate)
SIZES = {"h128-l2": (128, 2, 4, 2, 512), "h512-l8": (512, 8, 8, 4, 1536), "h1024-l16": (1024, 16, 16, 8, 2816)}


def build(root: Path) -> None:
    from demo.checkpoints import write_random_checkpoint

    for name, (hidden, layers, heads, kv, inter) in SIZES.items():
        write_random_checkpoint(
            root / name,
            "qwen2",
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv,
            head_dim=hidden // heads,
            intermediate_size=inter,
            vocab_size=151_646,
            tie_word_embeddings=True,
            rope_theta=1e6,
            max_position_embeddings=2048,
            seed=0,
            dtype="bfloat16",
        )


def timed(client: httpx.Client, url: str, model: str) -> float:
    start = time.perf_counter()
    r = client.post(
        f"{url}/v1/completions", json={"model": model, "prompt": "Hello", "max_tokens": 8, "ignore_eos": True}
    )
    r.raise_for_status()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "models"
        build(root)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "SPINDLE_LOG_LEVEL": "WARNING"}
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "server",
                "--models-dir",
                str(root),
                "--port",
                str(port),
                "--max-loaded-models",
                "1",
            ],
            env=env,
        )
        try:
            with httpx.Client(timeout=600) as client:
                wait_up(client, url, proc)
                names = list(SIZES)
                print(f"{'model':<12} {'cold s':>8} {'warm s':>8}")
                for i, name in enumerate(names):
                    other = names[(i + 1) % len(names)]
                    cold, warm = [], []
                    for _ in range(args.repeats):
                        timed(client, url, other)  # the other model loaded: this one is cold
                        cold.append(timed(client, url, name))
                        warm.append(timed(client, url, name))
                    print(f"{name:<12} {statistics.median(cold):>8.2f} {statistics.median(warm):>8.3f}")
        finally:
            proc.terminate()
            proc.wait(60)


def wait_up(client: httpx.Client, url: str, proc: subprocess.Popen[bytes]) -> None:
    while proc.poll() is None:
        try:
            if client.get(f"{url}/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"the server exited {proc.returncode}")


if __name__ == "__main__":
    main()
