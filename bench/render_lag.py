"""Event-loop lag while tokenizing a ~100k-token prompt (thread vs worker process), and the render hop cost.

    python -m bench.render_lag [--backend trio|asyncio]     (from the repo root)

A ticker task sleeps 10 ms in a loop and records how late it wakes: that lateness is what every other
request on the event loop waits. HF tokenizers hold the GIL for a whole `encode`, so a thread does not help.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from demo.tokenizers import tokenizer_dir
from server.render import template_sandbox
from server.render.renderer import Renderer, load_chat_template


def _text(n_words: int) -> str:
    rng = random.Random(0)
    words = ["hello", "world", "the", "quick", "brown", "fox", "jumps", "über", "数据", "lazy", "dog", "1234", "\n"]
    return " ".join(rng.choice(words) for _ in range(n_words))


async def _lag_during(work: Callable[[], Awaitable[Any]]) -> tuple[float, float, float]:
    """(max lag ms, p50 lag ms, work seconds) of a 10 ms ticker while `work` runs."""
    lags: list[float] = []
    done = anyio.Event()

    async def ticker() -> None:
        while not done.is_set():
            t = time.perf_counter()
            await anyio.sleep(0.01)
            lags.append(time.perf_counter() - t - 0.01)

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        await anyio.sleep(0.05)
        t = time.perf_counter()
        await work()
        elapsed = time.perf_counter() - t
        await anyio.sleep(0.03)
        done.set()
    return max(lags) * 1e3, statistics.median(lags) * 1e3, elapsed


async def main(backend: str) -> None:
    text = _text(80_000)
    async with Renderer.open(tokenizer_dir("qwen2"), num_workers=1) as r:
        n = len(r.tokenizer.encode(text).ids)
        print(f"backend={backend}  prompt: {len(text)} chars, {n} tokens")
        await r.encode(text)  # warm
        for name, work in [
            ("inline on the loop", lambda: _sync(lambda: r.tokenizer.encode(text))),
            ("thread (to_thread)", lambda: anyio.to_thread.run_sync(r.tokenizer.encode, text)),
            ("worker process", lambda: r.encode(text)),
        ]:
            worst, p50, secs = await _lag_during(work)
            print(f"  encode via {name:20s} took {secs * 1e3:7.1f} ms; loop lag max {worst:7.1f} ms, p50 {p50:5.2f} ms")

        msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"}]
        reps = 500
        template = load_chat_template(None, tokenizer_dir("qwen2"))
        assert template is not None
        t = time.perf_counter()
        for _ in range(reps):
            template_sandbox.render(
                template,
                msgs,
                add_generation_prompt=True,
                continue_final_message=False,
                tools=None,
                documents=None,
                kwargs={},
                max_output_chars=1 << 20,
            )
        inline_us = (time.perf_counter() - t) / reps * 1e6
        t = time.perf_counter()
        for _ in range(reps):
            await r.render_chat(msgs)
        hop_us = (time.perf_counter() - t) / reps * 1e6
        print(
            f"  ChatML render: in-process {inline_us:6.0f} us; via worker {hop_us:6.0f} us "
            f"(hop overhead {hop_us - inline_us:5.0f} us)"
        )
        short = "Why is the sky blue? Explain briefly."
        t = time.perf_counter()
        for _ in range(reps):
            await r.encode(short)
        enc_us = (time.perf_counter() - t) / reps * 1e6
        print(f"  encode of a {len(short)}-char text via Renderer.encode: {enc_us:6.0f} us")


async def _sync(fn: Callable[[], Any]) -> None:
    fn()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="trio", choices=["trio", "asyncio"])
    anyio.run(main, parser.parse_args().backend, backend=parser.parse_args().backend)
