"""Embedding throughput (no HTTP): inputs per second at batch 1 and 64 for 128-token inputs, `--runner pooling`
(LAST pooling, normalized) beside transformers' AutoModel on the same checkpoint (last_hidden_state, the same
pooling), in one run.

`--rerank`: documents per second of POST /rerank on the real server (`--runner pooling`, a cross-encoder:
bench/rerank_setup.py, or --model), 1 query x 64 documents of `--len` tokens per request, beside
sentence-transformers' CrossEncoder.predict on the same pairs and checkpoint, in one run.

    python -m bench.embed [--model DIR] [--dtype float32] [--threads 2] [--len 128] [--rounds 3] [--skip-hf]
    python -m bench.embed --rerank [--model DIR] [--threads 2] [--len 128] [--docs 64] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.messages import AddRequest, SamplingParams


def engine_embed(core: EngineCore, batch: int, length: int, rounds: int) -> float:
    """Inputs per second: `batch` inputs added at once, stepped until all are embedded; the median round."""
    rng = random.Random(batch)
    times = []
    for r in range(rounds + 1):  # round 0 warms up
        prompts = [[rng.randrange(core.vocab_size) for _ in range(length)] for _ in range(batch)]
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            core.add_request(AddRequest(f"e{batch}-{r}-{i}", p, SamplingParams(max_tokens=1), 0.0))
        done = 0
        while core.has_work:
            done += sum(o.pooled is not None for o in core.step())
        assert done == batch
        if r:
            times.append(time.perf_counter() - t0)
    return batch / statistics.median(times)


def hf_embed(model_dir: str, batch: int, length: int, rounds: int, dtype: torch.dtype) -> float:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, dtype=dtype).eval()
    times = []
    with torch.inference_mode():
        for r in range(rounds + 1):
            ids = torch.randint(0, model.config.vocab_size, (batch, length))
            t0 = time.perf_counter()
            hidden = model(ids).last_hidden_state
            F.normalize(hidden[:, -1].float(), dim=-1).tolist()
            if r:
                times.append(time.perf_counter() - t0)
    return batch / statistics.median(times)


def serve(model: Path, threads: int, port: int) -> subprocess.Popen[bytes]:
    """The real server on `model` as a pooling model, healthy."""
    import httpx

    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "SPINDLE_LOG_LEVEL": "WARNING"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "server",
            "--model",
            str(model),
            "--runner",
            "pooling",
            "--port",
            str(port),
            "--max-num-batched-tokens",
            "16384",
        ],
        env=env,
    )
    for _ in range(1200):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"the server exited {proc.returncode}")
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("the server did not come up")


def rerank(args: argparse.Namespace) -> None:
    """Documents per second: the server's /rerank and CrossEncoder.predict, 1 query x `--docs` documents."""
    import httpx

    from bench.rerank_setup import reranker_checkpoint, texts_of_length

    model = Path(args.model) if args.model else reranker_checkpoint()
    query = texts_of_length(model / "tokenizer.json", 1, 16, seed=1)[0]
    docs = texts_of_length(model / "tokenizer.json", args.docs, args.len, seed=2)
    proc = serve(model, args.threads, args.port)
    try:
        times = []
        for r in range(args.rounds + 1):  # round 0 warms up
            t0 = time.perf_counter()
            res = httpx.post(
                f"http://127.0.0.1:{args.port}/rerank", json={"query": query, "documents": docs}, timeout=600
            )
            assert res.status_code == 200 and len(res.json()["results"]) == args.docs, res.text
            if r:
                times.append(time.perf_counter() - t0)
        tokens = res.json()["usage"]["prompt_tokens"]
    finally:
        proc.terminate()
        proc.wait()
    line = (
        f"rerank 1 query x {args.docs} documents of {args.len} tokens ({tokens} tokens a request), "
        f"{args.threads} threads: spindle /rerank {args.docs / statistics.median(times):8.1f} documents/s"
    )
    if not args.skip_hf:  # torch at --threads, and at one thread as the engine's step runs on a busy machine
        for threads in sorted({args.threads, 1}, reverse=True):
            torch.set_num_threads(threads)
            line += (
                f"   CrossEncoder ({threads} threads) {cross_encoder(model, query, docs, args.rounds):8.1f} documents/s"
            )
    print(line, flush=True)


def cross_encoder(model: Path, query: str, docs: list[str], rounds: int) -> float:
    from sentence_transformers import CrossEncoder

    ce = CrossEncoder(str(model), device="cpu")
    times = []
    for r in range(rounds + 1):
        t0 = time.perf_counter()
        ce.predict([(query, d) for d in docs], batch_size=len(docs))
        if r:
            times.append(time.perf_counter() - t0)
    return len(docs) / statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the demo checkpoint)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--len", type=int, default=128, help="tokens per input")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--rerank", action="store_true", help="/rerank documents/s beside CrossEncoder")
    ap.add_argument("--docs", type=int, default=64, help="--rerank: documents per request")
    ap.add_argument("--port", type=int, default=8765, help="--rerank: the server's port")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.rerank:
        rerank(args)
        return
    if args.model is None:
        from demo.checkpoints import demo_checkpoint_path

        args.model = str(demo_checkpoint_path())
    # 64 x 128 tokens in one step, as transformers' single forward pass
    core = EngineCore(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
            runner="pooling",
            device=args.device,
            max_num_batched_tokens=max(2048, 64 * args.len),
        )
    )
    print(
        f"model {args.model} dtype {args.dtype} threads {args.threads} device {core.runner.device} "
        f"input {args.len} tokens"
    )
    for batch in (1, 64):
        line = f"batch {batch:3d}: spindle {engine_embed(core, batch, args.len, args.rounds):8.1f} inputs/s"
        if not args.skip_hf:
            hf = hf_embed(args.model, batch, args.len, args.rounds, getattr(torch, args.dtype))
            line += f"   transformers {hf:8.1f} inputs/s"
        print(line, flush=True)


if __name__ == "__main__":
    main()
