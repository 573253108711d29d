"""LoopHistogram and LoopCounter render exactly what prometheus_client's own Histogram and Counter render for the
same values."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from server.metrics.prometheus import ServerMetrics
from server.metrics.slots import LATENCY_BUCKETS

VALUES = [0.0, 0.001, 0.0010001, 0.02, 0.019999, 0.5, 7.5, 640.0, 640.5, 1e9, 0.06, 0.06]


def test_loop_histogram_matches_prometheus_client() -> None:
    ours = ServerMetrics("tiny")
    ref_registry = CollectorRegistry()
    ref = Histogram(
        "spindle_inter_token_latency_seconds",
        "Time between engine steps' tokens.",
        ["model_name"],
        buckets=LATENCY_BUCKETS,
        registry=ref_registry,
    ).labels("tiny")
    for v in VALUES:
        ours.itl.observe(v)
        ref.observe(v)

    def lines(text: bytes) -> list[str]:
        return [
            line
            for line in text.decode().splitlines()
            if line.startswith("spindle_inter_token_latency_seconds_") and "_created" not in line
        ]

    expected = lines(generate_latest(ref_registry))
    assert len(expected) == len(LATENCY_BUCKETS) + 3  # buckets with +Inf, count, sum
    assert lines(ours.render()) == expected


def test_loop_counters_match_prometheus_client() -> None:
    ours = ServerMetrics("tiny")
    ref_registry = CollectorRegistry()
    tokens = Counter("spindle_generation_tokens", "Generated tokens.", ["model_name"], registry=ref_registry)
    success = Counter(
        "spindle_request_success",
        "Finished requests by finish reason.",
        ["model_name", "finished_reason"],
        registry=ref_registry,
    )
    tokens.labels("tiny").inc(3)
    tokens.labels("tiny").inc(0.5)
    ours.generation_tokens.inc(3)
    ours.generation_tokens.inc(0.5)
    for reason in ("stop", "length", "abort", "error"):
        success.labels("tiny", reason)  # exported at 0, as ours are
    success.labels("tiny", "length").inc()
    ours.finished["length"].inc()

    def lines(text: bytes, created: bool) -> list[str]:
        names = ("spindle_generation_tokens", "spindle_request_success")
        return [
            line.rsplit(" ", 1)[0] if created else line
            for line in text.decode().splitlines()
            if any(f"{n}_" in line for n in names) and ("_created" in line) == created
        ]

    expected = lines(generate_latest(ref_registry), False)
    assert len(expected) == 2 * 2 + 1 + 4  # HELP and TYPE per family, then the samples
    assert lines(ours.render(), False) == expected
    assert lines(ours.render(), True) == lines(generate_latest(ref_registry), True)  # the _created samples' names
