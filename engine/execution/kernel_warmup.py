"""The CPU kernels made ready at start-up, before the engine says Ready, so that the first request's step waits for
none.

- the C++ kernel library (engine/cpu_kernels/build.py) is loaded, and built where its sources changed since the
  cached build (minutes of g++ on a busy machine): a float32 model calls its first kernel (the sampler's argmax)
  only inside a step, so a request could wait on the compiler while the server had said it was ready;
- a GGUF model's projections, built without knowing the activations' dtype, have their kernels chosen
  (engine/cpu_kernels/chooser.py) for the model's dtype, at every row class the scheduler uses (1 row for a decode
  step, the batch classes, a prefill's); choices stay cached on disk as before, so a restart times nothing.
A line is logged at least every LOG_EVERY_S while this runs (one compile or one shape's timing can outlast it)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from engine.cpu_kernels import build, chooser
from engine.layers.quant_linear import unchosen

log = logging.getLogger("engine")
LOG_EVERY_S = 10.0  # the longest start-up goes without a line while kernels are built or timed


@contextmanager
def _progress(say: list[str], every: float) -> Iterator[None]:
    """Log `say[0]` (updated by the caller) every `every` s until the block ends."""
    began, stop = time.monotonic(), threading.Event()

    def report() -> None:
        while not stop.wait(every):
            log.info("%s (%.0f s)", say[0], time.monotonic() - began)

    ticker = threading.Thread(target=report, name="kernel-warmup-progress", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        stop.set()
        ticker.join()


def prepare_kernels(dtype: torch.dtype, every: float = LOG_EVERY_S) -> None:
    """Load (or build) the kernel library, then choose the kernels of every projection still unchosen for
    activations of `dtype`."""
    say = ["loading the CPU kernels (built once per change of their sources)"]
    with _progress(say, every):
        build.library_digest()
        pending = unchosen(dtype)
        if not pending:
            return
        began, before = time.monotonic(), len(chooser.measured())
        log.info("timing kernels: %d projections (choices are cached: a restart reads them)", len(pending))
        for i, lin in enumerate(pending):
            say[0] = f"timing kernels: {i}/{len(pending)} projections"
            lin.choice(dtype)
    log.info(
        "timing kernels: done, %d projections (%d shapes timed, the rest cached) in %.1f s",
        len(pending),
        len(chooser.measured()) - before,
        time.monotonic() - began,
    )
