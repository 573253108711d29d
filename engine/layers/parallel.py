"""The threads a CPU step's big products are shared over: this thread plus `n - 1` pool threads.

torch's own intra-op threads (OpenMP) end every op at a barrier; when another process holds one of the
cores, every op waits for it (engine/execution/model_runner.py runs the step on one intra-op thread for that reason).
Here a product is cut into chunks that threads take as they come free: a thread held back slows only its
own chunk, and this thread takes over the rest. torch ops release the GIL, so the chunks run in parallel.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

log = logging.getLogger("engine")

KERNEL_PARALLEL_MACS = 1 << 22  # engine/cpu_kernels: smaller products on one thread (a team's fork and join
KERNEL_PARALLEL_BYTES = 1 << 20  # cost more than they save), unless they stream this much from memory
# a product over quantized blocks decodes them in registers: a team pays for itself from products this many times
# smaller (decoder_layer.cpp's kQuantWork is the same)
QUANT_WORK = 16


def _one_thread() -> None:
    torch.set_num_threads(1)  # each pool thread runs its chunk alone: no OpenMP team inside a chunk


CONTENDED = 0.5  # share of a window the step thread waited for a CPU, from which a team costs more than it gives
QUIET = 0.2  # below it, the team comes back
WINDOW = 0.5  # seconds of wall time per reading
MAX_HOLD = 32.0  # seconds on one thread after a team came back and found the machine busy again (doubling from 1)


class Contention:
    """Whether the machine is too busy for a thread team, from the kernel's count of the time this thread spent
    runnable but waiting for a CPU (/proc/thread-self/schedstat, its second field), read over wall-clock windows.

    Every op of a team ends at a barrier: on a busy machine one member waits a scheduler slice for the others at
    each of the hundreds of barriers a step has (a decode step ran 3x slower on two threads than on one with
    other work on both cores). On one thread there is no barrier to wait at."""

    def __init__(self, source: Path = Path("/proc/thread-self/schedstat")) -> None:
        self.source = source
        self.busy = False
        self._start: tuple[float, int, int] | None = None
        self._hold_until = float("-inf")
        self._hold = 1.0

    def _read(self) -> tuple[int, int] | None:
        try:
            run, wait = self.source.read_text().split()[:2]
            return int(run), int(wait)
        except (OSError, ValueError):  # no schedstat (another OS, a sandbox): never busy
            return None

    def observe(self, now: float) -> bool:
        """Called after each step on the step's thread; True when `busy` changed."""
        if self._start is None:
            got = self._read()
            self._start = (now, *got) if got is not None else None
            return False
        if now - self._start[0] < WINDOW or (got := self._read()) is None:
            return False
        ran, waited = got[0] - self._start[1], got[1] - self._start[2]
        self._start = (now, *got)
        share = waited / (ran + waited) if ran + waited > 0 else 0.0
        if not self.busy and share > CONTENDED:
            # busy again soon after a team came back: stay on one thread longer next time
            self._hold = min(MAX_HOLD, self._hold * 2) if now < self._hold_until + 2 * WINDOW else 1.0
            self._hold_until = now + self._hold
            self.busy = True
            return True
        if self.busy and share < QUIET and now >= self._hold_until:
            self.busy = False
            return True
        return False


class Workers:
    def __init__(self) -> None:
        self.n = 1
        self.pool: ThreadPoolExecutor | None = None
        self.split_projections = False  # engine/layers/linear.py cuts big projections only when set
        self.contention = Contention()

    @property
    def threads(self) -> int:
        """The threads a step may use now: all n, or one while the machine is too busy for a team."""
        return 1 if self.contention.busy else self.n

    def observe(self) -> None:
        """After each step: reads the contention meter (a reading every WINDOW seconds)."""
        if self.n > 1 and self.contention.observe(time.monotonic()):
            log.info("CPU %s: steps on %d thread(s)", "busy" if self.contention.busy else "free again", self.threads)

    def configure(self, n: int, split_projections: bool = False) -> None:
        """Use n threads (this one included) from now on; the pool is remade only when n changes."""
        self.split_projections = split_projections
        n = max(1, n)
        if n == self.n:
            return
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        self.n = n
        self.pool = (
            ThreadPoolExecutor(n - 1, thread_name_prefix="spindle-cpu", initializer=_one_thread) if n > 1 else None
        )

    def threads_for(self, macs: int, streamed_bytes: int = 0) -> int:
        """Threads for one engine/cpu_kernels call (an OpenMP team of its own, whatever torch's intra-op count
        is): all n when the call multiplies or streams enough to pay for the team, else one."""
        return self.threads if macs >= KERNEL_PARALLEL_MACS or streamed_bytes >= KERNEL_PARALLEL_BYTES else 1

    def run(self, work: Callable[[], None]) -> None:
        """Run `work` on every thread at once and wait for all; `work` pulls chunks from a shared iterator
        (each next() is atomic under the GIL), so each chunk runs once."""

        def in_inference() -> None:
            with torch.inference_mode():  # thread-local: the pool threads need it too
                work()

        helpers = [self.pool.submit(in_inference) for _ in range(self.threads - 1)] if self.pool is not None else []
        work()
        for f in helpers:
            f.result()


# One set per process: the runner configures it (its CPU thread count) before it loads the model.
WORKERS = Workers()
