"""The contention meter (engine/layers/parallel.py): one thread while the step thread waits for a CPU for more
than CONTENDED of a window, a team again below QUIET, and a longer hold each time a team comes back too early."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.layers.parallel import CONTENDED, QUIET, WINDOW, Contention, Workers

MS = 1_000_000


class Clock:
    def __init__(self, path: Path) -> None:
        self.path, self.now, self.run, self.wait = path, 0.0, 0, 0
        path.write_text("0 0 0\n")

    def window(self, meter: Contention, waited_share: float, seconds: float = WINDOW) -> bool:
        """One window of `seconds` in which the thread waited `waited_share` of its runnable time."""
        self.now += seconds
        total = int(seconds * 1000) * MS
        self.wait += int(total * waited_share)
        self.run += total - int(total * waited_share)
        self.path.write_text(f"{self.run} {self.wait} 7\n")
        return meter.observe(self.now)


@pytest.fixture
def meter(tmp_path: Path) -> tuple[Contention, Clock]:
    clock = Clock(tmp_path / "schedstat")
    m = Contention(clock.path)
    m.observe(clock.now)  # the first reading starts the first window
    return m, clock


def test_busy_over_the_threshold_not_at_or_under(meter: tuple[Contention, Clock]) -> None:
    m, clock = meter
    assert not clock.window(m, CONTENDED - 0.01) and not m.busy  # under
    assert not clock.window(m, CONTENDED) and not m.busy  # at
    assert clock.window(m, CONTENDED + 0.01) and m.busy  # over


def test_a_short_window_is_not_read(meter: tuple[Contention, Clock]) -> None:
    m, clock = meter
    assert not clock.window(m, 0.9, seconds=WINDOW / 2) and not m.busy  # half a window: not read yet
    assert clock.window(m, 0.9, seconds=WINDOW / 2) and m.busy  # the whole window read at once


def test_free_again_below_quiet_after_the_hold(meter: tuple[Contention, Clock]) -> None:
    m, clock = meter
    assert clock.window(m, 0.9) and m.busy
    assert not clock.window(m, QUIET) and m.busy  # at QUIET: still busy
    assert clock.window(m, QUIET - 0.01) and not m.busy  # under it, past the 1 s hold


def test_the_hold_doubles_when_a_team_finds_the_machine_busy_again(meter: tuple[Contention, Clock]) -> None:
    m, clock = meter
    clock.window(m, 0.9)  # busy: held 1 s
    clock.window(m, 0.0)
    assert clock.window(m, 0.0) and not m.busy  # free after 1 s
    assert clock.window(m, 0.9) and m.busy  # busy again at once: held 2 s
    for _ in range(3):
        assert not clock.window(m, 0.0) and m.busy  # 1.5 s of quiet: still held
    assert clock.window(m, 0.0) and not m.busy


def test_no_schedstat_is_never_busy(tmp_path: Path) -> None:
    m = Contention(tmp_path / "missing")
    for t in range(10):
        assert not m.observe(float(t))
    assert not m.busy


def test_threads_drop_to_one_while_busy() -> None:
    w = Workers()
    w.configure(2)
    try:
        assert w.threads == 2 and w.threads_for(1 << 30) == 2
        w.contention.busy = True
        assert w.threads == 1 and w.threads_for(1 << 30) == 1
        ran: list[int] = []
        w.run(lambda: ran.append(1))
        assert ran == [1]  # the work on this thread only: no pool helper waited for
    finally:
        w.configure(1)
