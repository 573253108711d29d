"""A load's log lines (not a terminal): one per 25 %, and one at least every 10 s however slowly tensors come."""

from __future__ import annotations

import io
import logging

import pytest

from engine.models import progress


def test_a_slow_load_logs_at_least_every_ten_seconds(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    clock = [100.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    caplog.set_level(logging.INFO, logger="engine")
    bar = progress.LoadProgress(1000, stream=io.StringIO())
    for _ in range(20):  # 2 % of the tensors, 6 s apart: no 25 % step, yet a line every 10 s
        clock[0] += 6.0
        bar.advance()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("loading weights:")]
    assert lines[0] == "loading weights: 1000 tensors"
    assert len(lines) == 1 + 10, lines  # 120 s: a line every second advance (12 s apart)
    bar.advance(300)  # past 25 %: the step line
    assert caplog.records[-1].getMessage() == "loading weights: 320/1000 tensors (32%)"
