"""The threads a CPU step's big products are shared over: this thread plus `n - 1` pool threads.

torch's own intra-op threads (OpenMP) end every op at a barrier; when another process holds one of the
cores, every op waits for it (engine/execution/model_runner.py runs the step on one intra-op thread for that reason).
Here a product is cut into chunks that threads take as they come free: a thread held back slows only its
own chunk, and this thread takes over the rest. torch ops release the GIL, so the chunks run in parallel.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

KERNEL_PARALLEL_MACS = 1 << 22  # engine/cpu_kernels: smaller products on one thread (a team's fork and join
KERNEL_PARALLEL_BYTES = 1 << 20  # cost more than they save), unless they stream this much from memory
# a product over quantized blocks decodes them in registers: a team pays for itself from products this many times
# smaller (decoder_layer.cpp's kQuantWork is the same)
QUANT_WORK = 16


def _one_thread() -> None:
    torch.set_num_threads(1)  # each pool thread runs its chunk alone: no OpenMP team inside a chunk


class Workers:
    def __init__(self) -> None:
        self.n = 1
        self.pool: ThreadPoolExecutor | None = None
        self.split_projections = False  # engine/layers/linear.py cuts big projections only when set

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
        return self.n if macs >= KERNEL_PARALLEL_MACS or streamed_bytes >= KERNEL_PARALLEL_BYTES else 1

    def run(self, work: Callable[[], None]) -> None:
        """Run `work` on every thread at once and wait for all; `work` pulls chunks from a shared iterator
        (each next() is atomic under the GIL), so each chunk runs once."""

        def in_inference() -> None:
            with torch.inference_mode():  # thread-local: the pool threads need it too
                work()

        helpers = [self.pool.submit(in_inference) for _ in range(self.n - 1)] if self.pool is not None else []
        work()
        for f in helpers:
            f.result()


# One set per process: the runner configures it (its CPU thread count) before it loads the model.
WORKERS = Workers()
