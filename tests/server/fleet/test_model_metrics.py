"""server/fleet/model_metrics.py: a model's counters and histograms outlive its unload and grow on from there at its
next load (Prometheus counters never go down); its gauges go with its engine."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from server.fleet.model_metrics import PerModelMetrics
from server.metrics.prometheus import ServerMetrics


def finished(metrics: ServerMetrics, n: int) -> None:
    for _ in range(n):
        metrics.record_finished(
            reason="stop",
            arrival=1.0,
            scheduled=1.5,
            first_token=2.0,
            finished=3.0,
            num_prompt_tokens=5,
            num_output_tokens=3,
        )


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(found: dict[Any, float], name: str, model: str, **labels: str) -> float | None:
    return found.get((name, tuple(sorted({"model_name": model, **labels}.items()))))


def test_counters_and_histograms_survive_an_unload_and_add_up_after_the_next_load() -> None:
    slots: dict[str, Any] = {"a": SimpleNamespace(name="a", loaded=None), "b": SimpleNamespace(name="b", loaded=None)}
    per_model = PerModelMetrics(slots)
    registry = CollectorRegistry()
    registry.register(per_model)
    first = ServerMetrics("a")
    first.running.set(3)
    finished(first, 2)
    slots["a"].loaded = SimpleNamespace(metrics=first)
    loaded = samples(registry)
    assert value(loaded, "spindle_request_success_total", "a", finished_reason="stop") == 2
    assert value(loaded, "spindle_num_requests_running", "a") == 3
    created = value(loaded, "spindle_request_success_created", "a", finished_reason="stop")

    per_model.keep(slots["a"])  # unloaded
    slots["a"].loaded = None
    unloaded = samples(registry)
    assert value(unloaded, "spindle_request_success_total", "a", finished_reason="stop") == 2
    assert value(unloaded, "spindle_e2e_request_latency_seconds_count", "a") == 2
    assert value(unloaded, "spindle_num_requests_running", "a") is None  # a gauge of an engine that is gone

    second = ServerMetrics("a")  # loaded again: its own counters start at 0
    finished(second, 1)
    slots["a"].loaded = SimpleNamespace(metrics=second)
    again = samples(registry)
    assert value(again, "spindle_request_success_total", "a", finished_reason="stop") == 3
    assert value(again, "spindle_e2e_request_latency_seconds_count", "a") == 3
    assert value(again, "spindle_e2e_request_latency_seconds_bucket", "a", le="+Inf") == 3
    assert value(again, "spindle_request_success_created", "a", finished_reason="stop") == created
    assert value(again, "spindle_num_requests_running", "a") == 0

    per_model.keep(slots["a"])  # a second unload adds to what the first kept
    slots["a"].loaded = None
    assert value(samples(registry), "spindle_request_success_total", "a", finished_reason="stop") == 3
    assert not any(key[1] and dict(key[1]).get("model_name") == "b" for key in samples(registry))
