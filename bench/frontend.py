"""Frontend micro-benchmark: the API server's CPU per streamed token, with a FAKE engine.

    python -m bench.frontend [--worker-class trio|asyncio|uvloop] [--concurrency 64]
        [--num-requests 256] [--output-len 128] [--step-ms 20]

The server is the real one (`server.runtime.http_server.serve`: Hypercorn, the app, AsyncLLM, output processor,
detokenizer with the demo checkpoint's tokenizer, SSE) in a subprocess, but its engine is
`PacedFakeEngine`, in-process, which gives every running request one token every --step-ms:
no model, no engine subprocess, so the figure is the frontend alone, on an otherwise quiet CPU.
The client is one thread of raw sockets (cheap, so it disturbs the server little), streaming
/v1/completions with token-id prompts. Reported: server CPU (user + sys, from /proc) per output
token, and per SSE event. Compare with ../shared/design.md's Hypercorn floor figures.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio

from bench.raw_streams import run_raw_streams
from bench.serve import cpu_seconds
from engine.messages import AddRequest, EngineStats, Ready, RequestOutput, StepOutputs

_STATS = EngineStats(0, 0, 0, 1000, 0, 0, 0)


class PacedFakeEngine:
    """A FAKE engine client for frontend benchmarks: one token per running request every `step_s`."""

    def __init__(self, token_ids: list[int], step_s: float, *, vocab_size: int, max_model_len: int) -> None:
        self.ready = Ready(
            max_model_len=max_model_len,
            vocab_size=vocab_size,
            eos_token_ids=[],
            num_blocks=1000,
            block_size=16,
            model_dtype="float32",
        )
        self.stats = _STATS
        self.token_ids = token_ids  # cycled through, so the detokenizer sees real text
        self.step_s = step_s
        self.running: dict[str, list[int]] = {}  # id -> [tokens so far, max_tokens]
        self._wake = anyio.Event()
        self._next = 0.0

    def add_request(self, req: AddRequest) -> None:
        self.running[req.request_id] = [0, req.params.max_tokens]
        self._wake.set()

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.running.pop(rid, None)

    async def receive(self) -> StepOutputs:
        while not self.running:
            self._wake = anyio.Event()
            await self._wake.wait()
            self._next = time.monotonic()
        self._next += self.step_s
        await anyio.sleep(max(self._next - time.monotonic(), 0.0))
        outputs, ids, n = [], self.token_ids, len(self.token_ids)
        for rid, st in list(self.running.items()):
            st[0] += 1
            done = st[0] >= st[1]
            outputs.append(RequestOutput(rid, [ids[st[0] % n]], "length" if done else None))
            if done:
                del self.running[rid]
        return StepOutputs(outputs, time.time(), _STATS)


def _serve(args: argparse.Namespace) -> int:
    from tokenizers import Tokenizer

    from demo.checkpoints import demo_checkpoint_path
    from server.config import ServerConfig
    from server.runtime.http_server import run_server

    model = str(demo_checkpoint_path())

    tok = Tokenizer.from_file(os.path.join(model, "tokenizer.json"))
    text = open(__file__, encoding="utf-8").read()  # varied text: words, spaces, punctuation, newlines
    ids = tok.encode(text).ids
    vocab = tok.get_vocab_size()

    @asynccontextmanager
    async def fake(_: Any) -> AsyncIterator[PacedFakeEngine]:
        yield PacedFakeEngine(ids, args.step_ms / 1000, vocab_size=vocab, max_model_len=4096)

    config = ServerConfig.from_settings(
        model=model, served_model_name="fake", port=args.port, worker_class=args.worker_class, log_level="warning"
    )
    return run_server(config, engine_factory=fake)


def _request(port: int, out_len: int, i: int) -> bytes:
    body = json.dumps(
        {"model": "fake", "prompt": [100 + i % 1000, 200, 300, 400], "max_tokens": out_len, "stream": True}
    ).encode()
    return (
        b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:%d\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % (port, len(body))
    ) + body


def _load(port: int, concurrency: int, num_requests: int, out_len: int) -> tuple[int, int, float]:
    """Run the requests with `concurrency` keep-alive connections; returns (events, requests ok, seconds)."""
    events = 0

    def done(buf: bytes) -> None:
        nonlocal events
        events += buf.count(b"data: {")

    ok, seconds = run_raw_streams(port, concurrency, num_requests, lambda i: _request(port, out_len, i), done)
    return events, ok, seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker-class", default="trio", choices=["trio", "asyncio", "uvloop"])
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--step-ms", type=float, default=20.0)
    ap.add_argument("--port", type=int, default=8411)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the server subprocess
    args = ap.parse_args()
    if args.serve:
        return _serve(args)
    cmd = [
        sys.executable,
        "-m",
        "bench.frontend",
        "--serve",
        "--worker-class",
        args.worker_class,
        "--port",
        str(args.port),
        "--step-ms",
        str(args.step_ms),
    ]
    server = subprocess.Popen(cmd)
    try:
        for _ in range(600):
            try:
                with socket.create_connection(("127.0.0.1", args.port), timeout=1) as s:
                    s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
                    if b" 200 " in s.recv(100):
                        break
            except OSError:
                pass
            if server.poll() is not None:
                raise SystemExit("the server did not start")
            time.sleep(0.2)
        _load(args.port, 4, 8, 8)  # warm-up
        c0 = cpu_seconds(server.pid)
        events, ok, secs = _load(args.port, args.concurrency, args.num_requests, args.output_len)
        cpu = cpu_seconds(server.pid) - c0
    finally:
        server.terminate()
        server.wait(30)
    tokens = ok * args.output_len
    print(f"worker={args.worker_class} concurrency={args.concurrency} requests={ok} step={args.step_ms} ms")
    print(f"output tok/s {tokens / secs:.1f}  events {events}  server CPU {cpu:.2f} s")
    print(f"api_cpu_us_per_token {cpu / tokens * 1e6:.1f}  api_cpu_us_per_event {cpu / max(events, 1) * 1e6:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
