"""LoopHistogram renders exactly what prometheus_client's own Histogram renders for the same values."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from server.metrics import LATENCY_BUCKETS, ServerMetrics

VALUES = [0.0, 0.001, 0.0010001, 0.02, 0.019999, 0.5, 7.5, 640.0, 640.5, 1e9, 0.06, 0.06]


def test_loop_histogram_matches_prometheus_client() -> None:
    ours = ServerMetrics("tiny")
    ref_registry = CollectorRegistry()
    ref = Histogram("spindle_inter_token_latency_seconds", "Time between engine steps' tokens.", ["model_name"],
                    buckets=LATENCY_BUCKETS, registry=ref_registry).labels("tiny")
    for v in VALUES:
        ours.itl.observe(v)
        ref.observe(v)

    def lines(text: bytes) -> list[str]:
        return [line for line in text.decode().splitlines()
                if line.startswith("spindle_inter_token_latency_seconds_") and "_created" not in line]

    expected = lines(generate_latest(ref_registry))
    assert len(expected) == len(LATENCY_BUCKETS) + 3  # buckets with +Inf, count, sum
    assert lines(ours.render()) == expected
