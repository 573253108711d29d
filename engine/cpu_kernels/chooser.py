"""Which kernel computes a product of this shape fastest on this machine, per row-count class, by measurement.

The kernel that wins on one CPU loses on another (on AMX machines oneDNN's tiles win prefill by far; on Zen 4
our AVX512-BF16 kernel wins decode), so no CPU flag decides: `choose(kind, shape, candidates)` times every
candidate at a representative row count of each class, interleaved (a busy core slows all alike), takes the
fastest of repeats, and caches the winners in the spindle cache under a key of the CPU model, the library
versions, the shape and the candidate names, so a restart times nothing. SPINDLE_KERNEL_CHOICE=name forces one (a
comma-separated list: the first that is a candidate).
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
from engine.cpu_kernels import build

log = logging.getLogger(__name__)

ROW_CLASSES: tuple[tuple[int, int], ...] = ((1, 1), (2, 4), (5, 16), (17, 64), (65, 1 << 30))  # last: prefill
TIMED_ROWS = (1, 4, 16, 64, 256)  # the row count timed for each class (its largest that a step often has)
SAMPLES = 5  # timed samples per candidate and class, interleaved
METHOD = "fastest-of-samples-3"  # part of the cache key: a change of how choices are timed or kept times them again
LONG_SAMPLES, LONG_CALL_S = 3, 10e-3  # fewer where every candidate's first call took this long
SAMPLE_S = 2e-3  # each sample repeats the call until it lasts about this long
MAX_REPEATS = 64
FORCE_ENV = "SPINDLE_KERNEL_CHOICE"

Bench = Callable[[int], Callable[[], object]]  # rows -> a zero-argument call that runs one product of that many rows
clock: Callable[[], float] = time.perf_counter  # tests put a fake clock here
_made: dict[tuple[str, tuple[int, ...], tuple[str, ...]], tuple[str, ...]] = {}
# (kind, shape) -> the candidates timed and their medians per class
_timed: dict[tuple[str, tuple[int, ...]], tuple[frozenset[str], list[dict[str, float]]]] = {}


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


def _time_class(rows: int, candidates: Mapping[str, Bench]) -> dict[str, float]:
    """The fastest sample of each candidate that runs at `rows` rows: the one least held up by other processes
    on a busy machine (a median follows the load; the minimum follows the kernel). One untimed call each first (it also
    sets how often a sample repeats the call); a candidate that raises is left out."""
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
    return {name: min(t) for name, t in times.items()}


def _fastest(medians: Mapping[str, float], names: Iterable[str]) -> str | None:
    among = [n for n in names if n in medians]
    return min(among, key=lambda n: (medians[n], n)) if among else None


def _measure(candidates: Mapping[str, Bench]) -> tuple[tuple[str, ...], list[dict[str, float]]]:
    """The winner per row class, and each class's medians (choose_held picks among fewer from them)."""
    winners: list[str] = []
    medians: list[dict[str, float]] = []
    for (lo, hi), rows in zip(ROW_CLASSES, TIMED_ROWS):
        medians.append(_time_class(rows, candidates))
        best = _fastest(medians[-1], candidates)
        if best is None:
            raise ChooserError(f"no candidate of {', '.join(candidates) or '(none)'} runs at {lo}-{hi} rows")
        winners.append(best)
    return tuple(winners), medians


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
    forced = next((f for f in map(str.strip, os.environ.get(FORCE_ENV, "").split(",")) if f in candidates), "")
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
            _write_cache(key, winners, medians)
        else:
            winners, medians = _measure(candidates)
            _write_cache(key, winners, medians)
        if (kind, tuple(shape)) not in _timed or frozenset(names) > _timed[(kind, tuple(shape))][0]:
            _timed[(kind, tuple(shape))] = frozenset(names), medians
    new = _made.get(memo) != winners
    _made[memo] = winners
    return winners, new


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


def forget() -> None:
    """Drop this process's memory of its choices (tests; the disk cache stays)."""
    _made.clear()
    _timed.clear()
