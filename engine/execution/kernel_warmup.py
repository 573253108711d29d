"""Kernel choices made at start-up, before the engine says Ready: a GGUF model's projections are built without
knowing the activations' dtype, so their kernels (engine/cpu_kernels/chooser.py) would otherwise be timed by the
first request's step (tens of seconds on a busy machine, after the server said it was ready). Here every such
projection is chosen for the model's dtype, at every row class the scheduler uses (1 row for a decode step, the
batch classes, a prefill's), with a log line at least every LOG_EVERY_S while it runs. Choices stay cached on disk
as before: a restart reads them and times nothing."""

from __future__ import annotations

import logging
import threading
import time

import torch

from engine.cpu_kernels import chooser
from engine.layers.quant_linear import unchosen

log = logging.getLogger("engine")
LOG_EVERY_S = 10.0  # the longest the timing goes without a line


def time_kernels(dtype: torch.dtype, every: float = LOG_EVERY_S) -> int:
    """Choose the kernels of every projection still unchosen for activations of `dtype`; returns how many."""
    pending = unchosen(dtype)
    if not pending:
        return 0
    done = [0]
    began, before = time.monotonic(), len(chooser.measured())
    stop = threading.Event()

    def report() -> None:  # one projection's timing can outlast `every`: a thread keeps the log alive
        while not stop.wait(every):
            log.info("timing kernels: %d/%d projections (%.0f s)", done[0], len(pending), time.monotonic() - began)

    log.info("timing kernels: %d projections (choices are cached: a restart reads them)", len(pending))
    ticker = threading.Thread(target=report, name="kernel-timing-progress", daemon=True)
    ticker.start()
    try:
        for lin in pending:
            lin.choice(dtype)
            done[0] += 1
    finally:
        stop.set()
        ticker.join()
    timed = len(chooser.measured()) - before
    log.info(
        "timing kernels: done, %d projections (%d shapes timed, the rest cached) in %.1f s",
        len(pending),
        timed,
        time.monotonic() - began,
    )
    return len(pending)
