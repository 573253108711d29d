"""spindle_engine_heartbeat_age_seconds: seconds since the last engine frame, computed when /metrics is scraped."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.messages import EngineStats
from server.metrics import prometheus as metrics_module
from server.metrics.prometheus import ServerMetrics

NAME = "spindle_engine_heartbeat_age_seconds"


def age(m: ServerMetrics) -> list[float]:
    return [s.value for f in text_string_to_metric_families(m.render().decode()) if f.name == NAME for s in f.samples]


def test_age_counts_from_the_last_frame(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(metrics_module.time, "monotonic", lambda: now[0])
    m = ServerMetrics("tiny")
    m.watch_engine()
    now[0] = 103.0
    assert age(m) == [3.0]  # no frame yet: since the server began watching (the model loads)
    m.record_stats(EngineStats(0, 0, 0, 1, 0, 0, 0))
    now[0] = 103.25
    assert age(m) == [0.25]
    now[0] = 115.0
    assert age(m) == [12.0]  # past SPINDLE_ENGINE_HEARTBEAT_TIMEOUT: the panel turns red


def test_not_exported_without_an_engine() -> None:
    assert age(ServerMetrics("tiny")) == []  # `spindle render` never calls watch_engine
