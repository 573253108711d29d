"""Which kernel computes a product of this shape fastest on this machine, per row-count class, by measurement.

The kernel that wins on one CPU loses on another (on AMX machines oneDNN's tiles win prefill by far; on Zen 4
our AVX512-BF16 kernel wins decode), so no CPU flag decides: `choose(kind, shape, candidates)` times every
candidate at a representative row count of each class, interleaved (a busy core slows all alike), takes the
fastest of repeats, and caches the winners in the spindle cache under a key of the CPU model, the library
versions, the shape and the candidate names, so a restart times nothing. SPINDLE_KERNEL_CHOICE=name forces one (a
comma-separated list: the first that is a candidate).

A timing taken while other processes held the cores is not cached: this process's threads waited for a CPU (the
kernel's run-queue delay; where unreadable, the timing thread's CPU time fell short of the wall time), or the
samples spread far above their fastest (`under_load`). Such a choice serves this run only and
is timed again at the next start, so a busy first start cannot keep a slow kernel for good.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import torch

from engine.cache_root import cache_root
from engine.config import EngineEnv
from engine.cpu_kernels import build

log = logging.getLogger(__name__)

ROW_CLASSES: tuple[tuple[int, int], ...] = ((1, 1), (2, 4), (5, 16), (17, 64), (65, 1 << 30))  # last: prefill
TIMED_ROWS = (1, 4, 16, 64, 256)  # the row count timed for each class (its largest that a step often has)
SAMPLES = 5  # timed samples per candidate and class, interleaved
METHOD = "quiet-fastest-of-samples-5"  # in the cache key: a change of how choices are timed or kept times them again
LONG_SAMPLES, LONG_CALL_S = 3, 10e-3  # fewer where every candidate's first call took this long
SAMPLE_S = 2e-3  # each sample repeats the call until it lasts about this long
MAX_REPEATS = 64
FORCE_ENV = "SPINDLE_KERNEL_CHOICE"
# under load: this process's threads together waited on a run queue this share of the timing's wall time ...
BUSY_WAIT_SHARE = 0.2
# ... (where that is unreadable: the timing thread ran less than this share of the wall time) ...
BUSY_CPU_SHARE = 0.8
# ... or the typical sample (the median over candidates and classes of each one's median / fastest) was this much
# slower than the fastest: on a quiet core repeated samples agree within a few per cent
BUSY_SPREAD = 1.3

Bench = Callable[[int], Callable[[], object]]  # rows -> a zero-argument call that runs one product of that many rows
clock: Callable[[], float] = time.perf_counter  # tests put a fake clock here
cpu_clock: Callable[[], float] = time.thread_time  # the timing thread's CPU seconds (tests fake it with `clock`)


def threads_run_delay() -> float | None:
    """Seconds this process's threads have spent runnable but waiting for a CPU (the second field of each
    /proc/self/task/*/schedstat), or None where the kernel does not say."""
    total = 0
    try:
        for task in os.scandir("/proc/self/task"):
            with open(f"{task.path}/schedstat") as f:
                total += int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return total / 1e9


run_delay: Callable[[], float | None] = threads_run_delay  # tests fake it
_made: dict[tuple[str, tuple[int, ...], tuple[str, ...]], tuple[str, ...]] = {}
# (kind, shape) -> the candidates timed and their medians per class
_timed: dict[tuple[str, tuple[int, ...]], tuple[frozenset[str], list[dict[str, float]]]] = {}
_loaded: set[tuple[str, tuple[int, ...]]] = set()  # (kind, shape) whose timing here was taken under load
_measured: list[tuple[str, tuple[int, ...]]] = []  # every (kind, shape) this process timed, in order


class ChooserError(RuntimeError):
    """No candidate could run at some row class."""


def row_class(rows: int) -> int:
    """The index into ROW_CLASSES of the class `rows` falls in (0 and fewer: the first)."""
    for i, (_, hi) in enumerate(ROW_CLASSES):
        if rows <= hi:
            return i
    return len(ROW_CLASSES) - 1


def cpu_model() -> str:
    """The CPU's model name as Linux gives it (the platform's processor string elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _library_hash() -> str:
    return build.library_digest() or "none"


def cache_key(kind: str, shape: tuple[int, ...], names: tuple[str, ...]) -> str:
    """What a cached choice is valid for: how it was timed, CPU model, torch and kernel library versions, threads,
    kind, shape, candidates."""
    parts = [
        METHOD,
        cpu_model(),
        torch.__version__,
        _library_hash(),
        str(torch.get_num_threads()),
        kind,
        "x".join(map(str, shape)),
        ",".join(sorted(names)),
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


def _cache_file(key: str) -> Path:
    return cache_root() / "kernel_choice" / f"{key}.json"


def _read_cache(key: str, names: tuple[str, ...]) -> tuple[tuple[str, ...], list[dict[str, float]]] | None:
    """The cached winners per class and the times they were chosen from, or None (absent, damaged or from
    another candidate set: measure again)."""
    try:
        got = json.loads(_cache_file(key).read_text())
        winners, times = got["winners"], got["times"]
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if (
        not isinstance(winners, list)
        or len(winners) != len(ROW_CLASSES)
        or not all(isinstance(n, str) and n in names for n in winners)
        or not isinstance(times, list)
        or len(times) != len(ROW_CLASSES)
        or not all(
            isinstance(m, dict) and all(n in names and isinstance(t, (int, float)) for n, t in m.items()) for m in times
        )
    ):
        return None
    return tuple(winners), [{n: float(t) for n, t in m.items()} for m in times]


def _write_cache(key: str, winners: tuple[str, ...], times: list[dict[str, float]]) -> None:
    path = _cache_file(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"winners": list(winners), "times": times}))
        os.replace(tmp, path)  # engines starting at once never read a half-written file
    except OSError as e:
        log.warning("kernel choice not cached (%s): it is measured again at the next start", e)


def _sample(call: Callable[[], object], repeats: int) -> float:
    t0 = clock()
    for _ in range(repeats):
        call()
    return (clock() - t0) / repeats


def _time_class(rows: int, candidates: Mapping[str, Bench]) -> dict[str, list[float]]:
    """The samples of each candidate that runs at `rows` rows (the caller keeps the fastest: the one least held up
    by other processes on a busy machine; a median follows the load, the minimum the kernel). One untimed call each
    first (it also sets how often a sample repeats the call); a candidate that raises is left out."""
    calls: dict[str, tuple[Callable[[], object], int]] = {}
    first_s: dict[str, float] = {}
    for name, bench in candidates.items():
        try:
            call = bench(rows)
            first = _sample(call, 1)
        except Exception as e:  # noqa: BLE001  # why: any failure of a candidate only removes it
            log.info("kernel %s skipped at %d rows: %s", name, rows, e)
            continue
        calls[name], first_s[name] = (call, max(1, min(MAX_REPEATS, int(SAMPLE_S / max(first, 1e-9))))), first
    if not calls:
        return {}
    times: dict[str, list[float]] = {name: [] for name in calls}
    long = all(repeats == 1 and first_s[name] >= LONG_CALL_S for name, (_, repeats) in calls.items())
    for _ in range(LONG_SAMPLES if long else SAMPLES):
        for name, (call, repeats) in calls.items():
            times[name].append(_sample(call, repeats))
    return times


def _fastest(medians: Mapping[str, float], names: Iterable[str]) -> str | None:
    among = [n for n in names if n in medians]
    return min(among, key=lambda n: (medians[n], n)) if among else None


def under_load(cpu_s: float, wall_s: float, samples: Iterable[list[float]], waited_s: float | None) -> str | None:
    """Why a timing looks held up by other processes (None: it does not): the time this process's threads waited
    for a CPU (None: unknown; then the timing thread's CPU time against the wall time), and how far the typical
    sample sits above its candidate's fastest."""
    if waited_s is not None and wall_s > 0 and waited_s > BUSY_WAIT_SHARE * wall_s:
        return f"threads waited {waited_s:.2f} s for a CPU in {wall_s:.2f} s"
    if waited_s is None and wall_s > 0 and cpu_s < BUSY_CPU_SHARE * wall_s:
        return f"the timing thread ran {cpu_s / wall_s:.0%} of the wall time"
    spreads = sorted(sorted(t)[len(t) // 2] / min(t) for t in samples if t and min(t) > 0)
    if spreads and (typical := spreads[len(spreads) // 2]) > BUSY_SPREAD:
        return f"the typical sample {typical:.2f}x its fastest"
    return None


def _measure(candidates: Mapping[str, Bench]) -> tuple[tuple[str, ...], list[dict[str, float]], str | None]:
    """The winner per row class, each class's fastest samples (choose_held picks among fewer from them), and why
    the timing looks taken under load (None: it does not)."""
    winners: list[str] = []
    fastest: list[dict[str, float]] = []
    samples: list[list[float]] = []
    cpu0, wall0, waited0 = cpu_clock(), clock(), run_delay()
    for (lo, hi), rows in zip(ROW_CLASSES, TIMED_ROWS):
        times = _time_class(rows, candidates)
        samples += times.values()
        fastest.append({name: min(t) for name, t in times.items()})
        best = _fastest(fastest[-1], candidates)
        if best is None:
            raise ChooserError(f"no candidate of {', '.join(candidates) or '(none)'} runs at {lo}-{hi} rows")
        winners.append(best)
    waited1 = run_delay()
    waited = None if waited0 is None or waited1 is None else waited1 - waited0
    return tuple(winners), fastest, under_load(cpu_clock() - cpu0, clock() - wall0, samples, waited)


def choose(kind: str, shape: tuple[int, ...], candidates: Mapping[str, Bench]) -> tuple[str, ...]:
    """Per row class, the name of the fastest candidate (timed on this machine at a representative row count of
    each class, interleaved, fastest of repeats), cached in the spindle cache under a key of the CPU model name,
    torch version, the kernel library's build hash, kind, shape and the candidate names, so a restart times
    nothing. A candidate that raises (or is absent) is skipped; if all fail, raises ChooserError (a single
    candidate is taken untimed). SPINDLE_KERNEL_CHOICE=name forces one candidate where present (for tests and
    benchmarks)."""
    winners, new = _choose(kind, shape, candidates)
    if new:
        _log(kind, shape, winners)
    return winners


def _log(kind: str, shape: tuple[int, ...], winners: tuple[str, ...]) -> None:
    log.info("kernels for %s %s by rows %s: %s", kind, "x".join(map(str, shape)), describe_classes(), " ".join(winners))


def _choose(kind: str, shape: tuple[int, ...], candidates: Mapping[str, Bench]) -> tuple[tuple[str, ...], bool]:
    """choose()'s answer, and whether this process had not made it before."""
    names = tuple(candidates)
    if not names:
        raise ChooserError(f"no candidate for {kind} {shape}")
    memo = (kind, tuple(shape), tuple(sorted(names)))
    # the first of a comma-separated list that is a candidate here (e.g. "dot,ggml": packed 4-bit, else blocks)
    forced = next((f for f in map(str.strip, EngineEnv.read().kernel_choice.split(",")) if f in candidates), "")
    if forced in candidates or len(names) == 1:  # forced, or nothing to choose between: nothing timed
        winners: tuple[str, ...] = (forced if forced in candidates else names[0],) * len(ROW_CLASSES)
    elif memo in _made:
        return _made[memo], False
    else:
        key = cache_key(kind, tuple(shape), names)
        cached = _read_cache(key, names)
        if cached is not None:
            winners, medians = cached
        elif (fewer := _from_timed(kind, tuple(shape), names)) is not None:
            winners, medians = fewer
            if (kind, tuple(shape)) not in _loaded:
                _write_cache(key, winners, medians)
        else:
            winners, medians, load = _measure(candidates)
            _measured.append((kind, tuple(shape)))
            _keep(key, kind, tuple(shape), winners, medians, load)
        if (kind, tuple(shape)) not in _timed or frozenset(names) > _timed[(kind, tuple(shape))][0]:
            _timed[(kind, tuple(shape))] = frozenset(names), medians
    new = _made.get(memo) != winners
    _made[memo] = winners
    return winners, new


def _keep(
    key: str,
    kind: str,
    shape: tuple[int, ...],
    winners: tuple[str, ...],
    times: list[dict[str, float]],
    load: str | None,
) -> None:
    """Cache a quiet timing; one taken under load serves this run only (the next start times again)."""
    if load is None:
        _write_cache(key, winners, times)
        return
    _loaded.add((kind, shape))
    log.info(
        "kernels for %s %s timed under load (%s): kept for this run only, timed again at the next start",
        kind,
        "x".join(map(str, shape)),
        load,
    )


def _from_timed(
    kind: str, shape: tuple[int, ...], names: tuple[str, ...]
) -> tuple[tuple[str, ...], list[dict[str, float]]] | None:
    """The winners among `names` (and their times) from this process's timing of a larger set of the same kind
    and shape (what choose_held asks second), or None where that timing did not cover every class."""
    timed, medians = _timed.get((kind, shape), (frozenset(), []))
    if not medians or not timed >= set(names):
        return None
    winners = tuple(_fastest(m, names) for m in medians)
    if None in winners:
        return None
    return tuple(w for w in winners if w is not None), [{n: t for n, t in m.items() if n in names} for m in medians]


def choose_held(
    kind: str, shape: tuple[int, ...], candidates: Mapping[str, Bench], form_of: Mapping[str, str]
) -> tuple[str, tuple[str, ...]]:
    """Where candidates need different weight layouts (`form_of`: candidate -> layout) and only one is held:
    (the layout held, the winner per class among its candidates). The layout held is the one whose best candidate
    loses least to the best of all, summed over the classes as log slowdowns (a layout 1.2x slower at decode but
    3x faster at prefill is kept over the other; ties: the one that wins a decode step's single row), then the
    classes are chosen again among its candidates."""
    winners, new = _choose(kind, shape, candidates)
    wins = [form_of[w] for w in winners]
    _, times = _timed.get((kind, tuple(shape)), (frozenset(), []))

    def cost(form: str) -> tuple[float, int, bool]:
        loss = 0.0
        for m in times:
            mine = [t for n, t in m.items() if form_of.get(n) == form]
            loss += math.log(min(mine) / min(m.values())) if mine and min(m.values()) > 0 else math.inf
        return loss, -wins.count(form), form != wins[0]

    held = min(dict.fromkeys(wins), key=cost)
    if len(set(wins)) > 1:
        winners, again = _choose(kind, shape, {n: b for n, b in candidates.items() if form_of[n] == held})
        new = new or again
    if new:  # one line per shape: the choice in effect
        _log(kind, shape, winners)
    return held, winners


def describe_classes() -> str:
    """ROW_CLASSES as the log and bench.profile_step write them: 1 2-4 5-16 17-64 65+."""
    return " ".join(str(lo) if lo == hi else f"{lo}-{hi}" if hi < 1 << 20 else f"{lo}+" for lo, hi in ROW_CLASSES)


def choices_made() -> list[tuple[str, tuple[int, ...], tuple[str, ...]]]:
    """Every choice this process made or read: (kind, shape, winner per row class), in the order made; of a
    kind and shape chosen twice (choose_held's second round), the last."""
    last = {(kind, shape): winners for (kind, shape, _), winners in _made.items()}
    return [(kind, shape, winners) for (kind, shape), winners in last.items()]


def measured() -> list[tuple[str, tuple[int, ...]]]:
    """Every (kind, shape) this process timed (not read from the cache), in the order timed."""
    return list(_measured)


def forget() -> None:
    """Drop this process's memory of its choices (tests; the disk cache stays)."""
    _made.clear()
    _measured.clear()
    _timed.clear()
    _loaded.clear()
