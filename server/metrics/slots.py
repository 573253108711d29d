"""Counters and histograms whose numbers live in shared slots: a row of doubles per API process.

Written on the event loop only (no lock); `MetricSlots` is a process's row, private at first and moved by
`ServerMetrics.share` (server/metrics/prometheus.py) into memory every API process maps (server/shared_state.py),
so totals are sums over the processes' rows.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Protocol

LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)
NUM_BUCKETS = len(LATENCY_BUCKETS) + 1  # with +Inf
_PRIVATE_VALUES = 512  # doubles in a process's own row: more than the counters and histograms take


class Row(Protocol):
    """Doubles by index: a list (one process) or a memoryview of shared memory (several)."""

    def __getitem__(self, i: int, /) -> float: ...
    def __setitem__(self, i: int, value: float, /) -> None: ...


class MetricSlots:
    """Where counters and histograms keep their numbers: one row of doubles per API process, this process
    writing row `index` only (one writer per row: no lock); a value's total is the sum over the rows.
    Values are placed in the same order in every process, so a value has the same offset in every row."""

    def __init__(self, view: Row, num_processes: int, index: int, stride: int, capacity: int) -> None:
        if capacity > stride:
            raise ValueError(f"a row of {stride} values cannot hold {capacity}")
        self.view = view
        self.num_processes = num_processes
        self.index = index
        self.stride = stride  # values from one row to the next
        self.capacity = capacity  # values of each row that may be taken
        self._next = 0

    @classmethod
    def private(cls, capacity: int = _PRIVATE_VALUES) -> MetricSlots:
        """One process's row, in its own memory (a list: cheaper per write than a memoryview)."""
        return cls([0.0] * capacity, 1, 0, capacity, capacity)

    def take(self, count: int) -> int:
        """The offset of `count` more values in every row."""
        offset, self._next = self._next, self._next + count
        if self._next > self.capacity:
            raise RuntimeError(f"{self._next} metric values do not fit a row of {self.capacity}")
        return offset

    def own(self, offset: int) -> int:
        return self.index * self.stride + offset

    def rows(self, offset: int) -> list[int]:
        return [p * self.stride + offset for p in range(self.num_processes)]


class Placed:
    """`size` values in a MetricSlots row; `move_to` carries this process's values into other slots."""

    __slots__ = ("_view", "_own", "_rows")
    size = 1

    def __init__(self, slots: MetricSlots, offset: int | None = None) -> None:
        self._place(slots, slots.take(self.size) if offset is None else offset)

    def _place(self, slots: MetricSlots, offset: int) -> None:
        self._view = slots.view
        self._own = slots.own(offset)
        self._rows = slots.rows(offset)

    def _total(self, i: int) -> float:
        view = self._view
        return float(sum(view[r + i] for r in self._rows))

    def move_to(self, slots: MetricSlots) -> None:
        old, own = self._view, self._own
        self._place(slots, slots.take(self.size))
        for i in range(self.size):
            self._view[self._own + i] = old[own + i]


class LoopCounter(Placed):
    """A counter written on the event loop only (no lock); `get` sums every process's row."""

    __slots__ = ()

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError(f"counters only go up: inc({amount})")
        self._view[self._own] += amount

    def get(self) -> float:
        return self._total(0)

    def get_own(self) -> float:
        return float(self._view[self._own])

    def per_process(self) -> list[float]:
        view = self._view
        return [float(view[r]) for r in self._rows]


class LoopHistogram(Placed):
    """A histogram observed and rendered on the event loop only, so it needs no lock: one bisect per
    observation (prometheus_client's Histogram takes a lock for the sum and one for the bucket, which
    showed up in the API CPU per token for the per-token ITL: bench/README.md, "Lock-free latency histograms").
    Its row holds the buckets (le semantics, the last one +Inf), then the sum."""

    __slots__ = ()
    size = NUM_BUCKETS + 1

    def observe(self, value: float) -> None:
        view, own = self._view, self._own
        view[own + bisect_left(LATENCY_BUCKETS, value)] += 1  # le semantics: value <= bound
        view[own + NUM_BUCKETS] += value

    @property
    def counts(self) -> list[int]:
        return [int(self._total(i)) for i in range(NUM_BUCKETS)]

    @property
    def sum(self) -> float:
        return self._total(NUM_BUCKETS)
