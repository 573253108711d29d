"""What the API-server processes of one server share (`--api-server-count N`): admission counts and metrics.

One shared memory file (a memfd the launcher makes and every API process maps, `SharedRegion`) holds, per
API process, its own slot: its queued requests and prompt tokens (`SharedAdmission`) and the values of its
request counters and histograms (`share_metrics`; server/metrics/prometheus.py `MetricSlots`). Each slot has exactly
one writer, its process, and is read by all: totals are sums over the slots. No locks between processes, so no process
ever waits on
another (a stopped or slow process cannot stall the others' event loops).

Admission is reserve-then-check (Dekker's pattern): a process adds the request to its own slot first, then
a full memory fence, then sums every slot; over a limit, it takes its reservation back and refuses. Two
processes admitting at once each see the other's reservation (the fences order each store before the other's
loads), so together they can never exceed a limit; the price is that both may refuse when only one would
have fitted (a 503 with Retry-After, never an overrun). Releases only lower the owner's slot. Nothing is
ever undercounted: an admitted request stays in its process's slot until its first token or its end.

The fence is an uncontended `threading.Lock` acquire and release: in CPython that is an atomic
read-modify-write (a `lock`-prefixed instruction on x86-64, a full barrier there). Values are aligned
8-byte words written by single stores, so a reader never sees a torn value.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading

from server.metrics.prometheus import ServerMetrics
from server.metrics.slots import LoopCounter, MetricSlots
from server.request.admission import Admission

ADMISSION_SLOT = 64  # bytes per process: two int64 (requests, tokens), a cache line each process owns
METRICS_SLOT = 64 << 10  # bytes per process: 8192 doubles, far more than the counters and histograms need
ENGINE_VALUES = 256  # the last values of each metrics slot: requests routed per engine (`engine_routed`)


def region_size(num_processes: int) -> int:
    return num_processes * (ADMISSION_SLOT + METRICS_SLOT)


class SharedRegion:
    """The mapping of the shared file: `num_processes` slots, `index` being this process's."""

    def __init__(self, fd: int, num_processes: int, index: int) -> None:
        if not 0 <= index < num_processes:
            raise ValueError(f"process index {index} outside 0..{num_processes - 1}")
        self.num_processes = num_processes
        self.index = index
        self._map = mmap.mmap(fd, region_size(num_processes))
        # admission: [reqs, tokens] per process, one cache line apart
        self.admission = [(ctypes.c_int64 * 2).from_buffer(self._map, i * ADMISSION_SLOT) for i in range(num_processes)]
        base = num_processes * ADMISSION_SLOT
        self.metrics = memoryview(self._map)[base : base + num_processes * METRICS_SLOT].cast("d")
        self.metrics_stride = METRICS_SLOT // 8

    @classmethod
    def create(cls, num_processes: int) -> tuple[int, SharedRegion]:
        """A new zeroed shared file (its fd, inheritable by children) and process 0's view of it."""
        fd = os.memfd_create("spindle-api-servers", 0)
        os.ftruncate(fd, region_size(num_processes))
        return fd, cls(fd, num_processes, 0)


_fence_lock = threading.Lock()


def fence() -> None:
    """A full memory barrier (see the module docstring)."""
    _fence_lock.acquire()
    _fence_lock.release()


class SharedAdmission(Admission):
    """Admission whose limits hold for every API process together (module docstring: reserve, fence, check)."""

    def __init__(
        self, region: SharedRegion, max_num_queued_reqs: int | None, max_num_queued_tokens: int | None
    ) -> None:
        super().__init__(max_num_queued_reqs, max_num_queued_tokens)
        self._slots = region.admission
        self._own = region.admission[region.index]

    def _totals(self) -> tuple[int, int]:
        reqs = tokens = 0
        for slot in self._slots:
            reqs += slot[0]
            tokens += slot[1]
        return reqs, tokens

    @property
    def queued_reqs(self) -> int:
        return self._totals()[0]

    @property
    def queued_tokens(self) -> int:
        return self._totals()[1]

    @property
    def own(self) -> tuple[int, int]:
        """This process's queued requests and tokens."""
        return self._own[0], self._own[1]

    def try_admit(
        self, num_reqs: int, num_tokens: int, *, held: tuple[int, int] = (0, 0), bound: str = ""
    ) -> str | None:
        if num_reqs < 0 or num_tokens < 0:
            raise ValueError(f"cannot admit {num_reqs} requests with {num_tokens} tokens")
        own = self._own
        more_reqs, more_tokens = num_reqs - held[0], num_tokens - held[1]
        own[0] += more_reqs  # reserve: visible to the others before we look at them
        own[1] += more_tokens
        fence()
        reqs, tokens = self._totals()
        reason = self._refusal_at(reqs - num_reqs, tokens - num_tokens, num_reqs, num_tokens, bound)
        if reason is not None:
            own[0] -= more_reqs
            own[1] -= more_tokens
        return reason

    def release(self, num_reqs: int, num_tokens: int) -> None:
        own = self._own
        if num_reqs < 0 or num_tokens < 0 or num_reqs > own[0] or num_tokens > own[1]:
            raise RuntimeError(
                f"releasing {num_reqs} requests / {num_tokens} tokens but only {own[0]} / {own[1]} "
                "are queued in this process: a request was released twice or never admitted"
            )
        own[0] -= num_reqs
        own[1] -= num_tokens


def _slots(region: SharedRegion, capacity: int) -> MetricSlots:
    return MetricSlots(region.metrics, region.num_processes, region.index, region.metrics_stride, capacity)


def engine_routed(region: SharedRegion, num_engines: int) -> list[LoopCounter]:
    """Per engine (`--data-parallel-size`), the requests this process sent there, in its slot (`inc`);
    `get` sums every process, so spindle_engine_requests_routed{engine} counts the whole server."""
    if num_engines > ENGINE_VALUES:
        raise ValueError(f"at most {ENGINE_VALUES} engines behind several API processes, got {num_engines}")
    slots = _slots(region, region.metrics_stride)
    base = region.metrics_stride - ENGINE_VALUES
    return [LoopCounter(slots, base + i) for i in range(num_engines)]


def share_metrics(metrics: ServerMetrics, region: SharedRegion) -> None:
    """Move a fresh ServerMetrics' request counters and histograms into this process's metrics slot, so every
    process's /metrics shows the sums over all processes (ServerMetrics.share). Call before anything records:
    the others would not see it."""
    metrics.share(_slots(region, region.metrics_stride - ENGINE_VALUES))
