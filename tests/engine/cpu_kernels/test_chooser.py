"""The kernel chooser with fake candidates on a fake clock: each call advances the clock by the cost its
candidate is given, so no test depends on this machine's speed."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from engine.cache_root import cache_root
from engine.cpu_kernels import chooser


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[FakeClock]:
    fake = FakeClock()
    monkeypatch.setattr(chooser, "clock", fake)
    monkeypatch.setattr(chooser, "cpu_clock", fake)  # the timing thread ran all the wall time: a quiet machine
    monkeypatch.setattr(chooser, "run_delay", lambda: None)  # the kernel's run-queue delay unknown
    monkeypatch.setattr(chooser, "_library_hash", lambda: "built")  # no kernel build in a fresh cache per test
    monkeypatch.setenv("SPINDLE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(chooser.FORCE_ENV, raising=False)
    chooser.forget()
    yield fake
    chooser.forget()


class Fake:
    """A candidate whose call at `rows` rows costs cost(rows) seconds on the fake clock; counts its calls."""

    def __init__(self, clock: FakeClock, cost: Callable[[int], float]) -> None:
        self.clock, self.cost, self.calls = clock, cost, 0

    def __call__(self, rows: int) -> Callable[[], object]:
        def run() -> None:
            self.calls += 1
            self.clock.t += self.cost(rows)

        return run


def test_row_classes_cover_every_row_count() -> None:
    assert [chooser.row_class(r) for r in (0, 1, 2, 4, 5, 16, 17, 64, 65, 4096)] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert chooser.describe_classes() == "1 2-4 5-16 17-64 65+"


def test_it_picks_the_faster_per_class(clock: FakeClock) -> None:
    # "ours" costs a flat 1 ms per row, "tiles" a fixed 10 ms plus 0.1 ms per row: ours wins up to 11 rows
    ours = Fake(clock, lambda rows: 1e-3 * rows)
    tiles = Fake(clock, lambda rows: 1e-2 + 1e-4 * rows)
    got = chooser.choose("bf16", (64, 32), {"ours": ours, "tiles": tiles})
    assert got == ("ours", "ours", "tiles", "tiles", "tiles")
    assert chooser.choices_made() == [("bf16", (64, 32), got)]


def test_a_second_call_times_nothing_and_a_restart_reads_the_cache(clock: FakeClock) -> None:
    a, b = Fake(clock, lambda rows: 2e-3), Fake(clock, lambda rows: 1e-3)
    first = chooser.choose("bf16", (8, 8), {"a": a, "b": b})
    calls = a.calls + b.calls
    assert first == ("b",) * 5 and calls > 0
    assert chooser.choose("bf16", (8, 8), {"a": a, "b": b}) == first
    chooser.forget()  # as a new process: only the disk cache is left
    assert chooser.choose("bf16", (8, 8), {"a": a, "b": b}) == first
    assert a.calls + b.calls == calls


@pytest.mark.parametrize("change", ["shape", "kind", "candidates", "cpu", "torch", "library"])
def test_it_measures_again_when_the_key_changes(clock: FakeClock, monkeypatch: pytest.MonkeyPatch, change: str) -> None:
    a, b = Fake(clock, lambda rows: 2e-3), Fake(clock, lambda rows: 1e-3)
    chooser.choose("bf16", (8, 8), {"a": a, "b": b})
    chooser.forget()
    before = a.calls + b.calls
    kind, shape, cands = "bf16", (8, 8), {"a": a, "b": b}
    if change == "shape":
        shape = (8, 16)
    elif change == "kind":
        kind = "int8"
    elif change == "candidates":
        cands = {"a": a, "b": b, "c": Fake(clock, lambda rows: 3e-3)}
    elif change == "cpu":
        monkeypatch.setattr(chooser, "cpu_model", lambda: "Another CPU")
    elif change == "torch":
        monkeypatch.setattr(torch, "__version__", "0.0.0")
    else:
        monkeypatch.setattr(chooser, "_library_hash", lambda: "rebuilt")
    chooser.choose(kind, shape, cands)
    assert a.calls + b.calls > before


def test_a_candidate_that_raises_is_skipped(clock: FakeClock) -> None:
    def broken(rows: int) -> Callable[[], object]:
        def run() -> None:
            raise RuntimeError("illegal instruction")

        return run

    def unbuildable(rows: int) -> Callable[[], object]:
        raise ValueError("this shape does not fit")

    slow = Fake(clock, lambda rows: 5e-3)
    got = chooser.choose("bf16", (8, 8), {"broken": broken, "unbuildable": unbuildable, "slow": slow})
    assert got == ("slow",) * 5


def test_a_candidate_failing_at_some_rows_only_loses_those(clock: FakeClock) -> None:
    fast = Fake(clock, lambda rows: 1e-4)

    def small_only(rows: int) -> Callable[[], object]:
        if rows > 16:
            raise ValueError("too many rows")
        return fast(rows)

    got = chooser.choose("bf16", (8, 8), {"small": small_only, "slow": Fake(clock, lambda rows: 1e-3)})
    assert got == ("small", "small", "small", "slow", "slow")


def test_nothing_that_runs_raises_the_chooser_error(clock: FakeClock) -> None:
    def broken(rows: int) -> Callable[[], object]:
        raise RuntimeError("no")

    with pytest.raises(chooser.ChooserError):
        chooser.choose("bf16", (8, 8), {"broken": broken, "also broken": broken})
    with pytest.raises(chooser.ChooserError):
        chooser.choose("bf16", (8, 8), {})


def test_a_single_candidate_is_taken_untimed(clock: FakeClock) -> None:
    only = Fake(clock, lambda rows: 1e-3)
    assert chooser.choose("bf16", (8, 8), {"only": only}) == ("only",) * 5 and only.calls == 0


def test_the_environment_forces_a_present_candidate(clock: FakeClock, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = Fake(clock, lambda rows: 2e-3), Fake(clock, lambda rows: 1e-3)
    monkeypatch.setenv(chooser.FORCE_ENV, "a")
    assert chooser.choose("bf16", (8, 8), {"a": a, "b": b}) == ("a",) * 5
    assert a.calls + b.calls == 0  # nothing timed
    monkeypatch.setenv(chooser.FORCE_ENV, "absent")  # a name not offered: measured as usual
    chooser.forget()
    assert chooser.choose("bf16", (8, 8), {"a": a, "b": b}) == ("b",) * 5


def test_a_damaged_cache_is_measured_again(clock: FakeClock) -> None:
    a, b = Fake(clock, lambda rows: 2e-3), Fake(clock, lambda rows: 1e-3)
    chooser.choose("bf16", (8, 8), {"a": a, "b": b})
    chooser.forget()
    for f in (cache_root() / "kernel_choice").iterdir():
        f.write_text("not json")
    before = a.calls + b.calls
    assert chooser.choose("bf16", (8, 8), {"a": a, "b": b}) == ("b",) * 5
    assert a.calls + b.calls > before


def test_one_layout_held_where_the_winners_need_two(clock: FakeClock) -> None:
    """ "tiles" wins prefill only: the layout that wins more classes is kept, its candidates chosen again."""
    ours = Fake(clock, lambda rows: 5e-5 * rows)
    ours_unpacked = Fake(clock, lambda rows: 3e-3 + 1e-5 * rows)
    tiles = Fake(clock, lambda rows: 1e-3 + 1e-6 * rows)
    form_of = {"ours": "packed", "ours-unpacked": "packed", "tiles": "blocked"}
    chooser.choose("bf16", (8, 8), {"ours": ours, "ours-unpacked": ours_unpacked, "tiles": tiles})
    first = ours.calls + ours_unpacked.calls + tiles.calls
    held, got = chooser.choose_held(
        "bf16", (8, 8), {"ours": ours, "ours-unpacked": ours_unpacked, "tiles": tiles}, form_of
    )
    assert held == "packed" and got == ("ours", "ours", "ours", "ours", "ours-unpacked")
    assert chooser.choices_made() == [("bf16", (8, 8), got)]  # the choice in effect
    calls = ours.calls + ours_unpacked.calls + tiles.calls
    assert calls == first  # the second round took the first one's timings
    chooser.forget()  # a restart: both rounds come from the disk cache
    assert chooser.choose_held(
        "bf16", (8, 8), {"ours": ours, "ours-unpacked": ours_unpacked, "tiles": tiles}, form_of
    ) == (held, got)
    assert ours.calls + ours_unpacked.calls + tiles.calls == calls
    # a smaller set timed first does not answer for a larger one
    chooser.forget()
    assert chooser.choose("bf16", (4, 4), {"tiles": tiles, "ours-unpacked": ours_unpacked}) == ("tiles",) * 5
    assert chooser.choose("bf16", (4, 4), {"tiles": tiles, "ours": ours, "ours-unpacked": ours_unpacked})[0] == "ours"


def test_samples_held_up_by_other_processes_do_not_decide(clock: FakeClock) -> None:
    """On a busy machine most samples of the faster kernel may be held up: its fastest sample still wins."""
    fast = Fake(clock, lambda rows: 1e-3 if fast.calls <= 3 else 5e-3)  # the untimed call and one clean sample

    got = chooser.choose("bf16", (8, 4), {"fast": fast, "other": Fake(clock, lambda rows: 2e-3)})
    assert got[0] == "fast"


def test_one_slow_sample_does_not_decide(clock: FakeClock) -> None:
    hiccup = iter([1e-3, 1.0])  # after the untimed call, one sample of "steady" is held up by another process

    def cost(rows: int) -> float:
        return next(hiccup, 1e-3)

    got = chooser.choose("bf16", (8, 8), {"steady": Fake(clock, cost), "other": Fake(clock, lambda rows: 2e-3)})
    assert got[0] == "steady"


def test_the_layout_held_loses_least_over_all_classes(clock: FakeClock) -> None:
    """ "ours" wins three classes by 10% but is 4x slower at prefill: the layout of "tiles" is held, and so after
    a restart, from the times in the cache."""
    ours = Fake(clock, lambda rows: 1e-3 * rows if rows <= 16 else 4e-3 * rows)
    tiles = Fake(clock, lambda rows: 1.1e-3 * rows if rows <= 16 else 1e-3 * rows)
    form_of = {"ours": "packed", "tiles": "blocked"}
    held, got = chooser.choose_held("bf16", (8, 8), {"ours": ours, "tiles": tiles}, form_of)
    assert (held, got) == ("blocked", ("tiles",) * 5)
    chooser.forget()
    calls = ours.calls + tiles.calls
    assert chooser.choose_held("bf16", (8, 8), {"ours": ours, "tiles": tiles}, form_of) == (held, got)
    assert ours.calls + tiles.calls == calls


class HeldClock:
    """The timing thread's CPU clock on a machine where other processes hold its core part of the time: it runs at
    `share` of the wall clock's pace."""

    def __init__(self, wall: FakeClock, share: float) -> None:
        self.wall, self.share = wall, share

    def __call__(self) -> float:
        return self.wall.t * self.share


def test_the_load_detector_reads_cpu_share_and_spread() -> None:
    steady = [[1.0, 1.02, 1.01, 1.0, 1.03]] * 4
    assert chooser.under_load(9.5, 10.0, steady, None) is None
    assert "ran 50% of the wall time" in str(chooser.under_load(5.0, 10.0, steady, None))
    # with the run-queue delay known it decides (a thread asleep at a barrier is not load)
    assert chooser.under_load(5.0, 10.0, steady, 0.5) is None
    assert "waited 3.00 s for a CPU in 10.00 s" in str(chooser.under_load(10.0, 10.0, steady, 3.0))
    held = [[1.0, 1.6, 1.7, 1.5, 2.0]] * 3 + steady[:2]  # most candidates' samples held up, the CPU time not told
    assert "1.60x its fastest" in str(chooser.under_load(10.0, 10.0, held, 0.0))
    one_hiccup = [[1.0, 9.0, 1.0, 1.0, 1.0]] + steady  # one held-up sample is not load
    assert chooser.under_load(10.0, 10.0, one_hiccup, None) is None


def test_a_timing_under_load_serves_this_run_only(clock: FakeClock, monkeypatch: pytest.MonkeyPatch) -> None:
    """Timed while the CPU clock ran at half the wall's pace: the choice is used but not cached, so the next start
    times again, on a quiet machine, and keeps that choice."""
    a, b = Fake(clock, lambda rows: 2e-3), Fake(clock, lambda rows: 1e-3)
    monkeypatch.setattr(chooser, "cpu_clock", HeldClock(clock, 0.5))
    assert chooser.choose("bf16", (8, 8), {"a": a, "b": b}) == ("b",) * 5
    calls = a.calls + b.calls
    assert chooser.choose("bf16", (8, 8), {"a": a, "b": b}) == ("b",) * 5  # this run remembers it
    assert a.calls + b.calls == calls
    assert not list((cache_root() / "kernel_choice").glob("*.json"))
    chooser.forget()  # the next start, now quiet: timed again, and cached
    monkeypatch.setattr(chooser, "cpu_clock", clock)
    assert chooser.choose("bf16", (8, 8), {"a": a, "b": b}) == ("b",) * 5
    assert a.calls + b.calls > calls
    assert len(list((cache_root() / "kernel_choice").glob("*.json"))) == 1


def test_run_queue_waits_mark_a_timing_loaded(clock: FakeClock, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU clock keeps pace, but the process's threads waited for a CPU for half the timing: not cached."""
    monkeypatch.setattr(chooser, "run_delay", lambda: clock.t / 2)
    chooser.choose("bf16", (8, 8), {"a": Fake(clock, lambda rows: 2e-3), "b": Fake(clock, lambda rows: 1e-3)})
    assert not list((cache_root() / "kernel_choice").glob("*.json"))


def test_the_run_queue_delay_of_this_process_reads() -> None:
    waited = chooser.threads_run_delay()
    assert waited is None or waited >= 0.0


def test_a_held_layout_from_a_loaded_timing_is_not_cached_either(
    clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """choose_held's second round (among the held layout's candidates) reuses the loaded timing: not cached."""
    ours = Fake(clock, lambda rows: 1e-3 * rows if rows <= 16 else 4e-3 * rows)
    tiles = Fake(clock, lambda rows: 1.1e-3 * rows if rows <= 16 else 1e-3 * rows)
    monkeypatch.setattr(chooser, "cpu_clock", HeldClock(clock, 0.6))
    chooser.choose_held("bf16", (8, 8), {"ours": ours, "tiles": tiles}, {"ours": "packed", "tiles": "blocked"})
    assert not list((cache_root() / "kernel_choice").glob("*.json"))
