"""Prometheus metrics, recorded in the API server from the engine's timestamps.

The engine core never touches Prometheus: it reports cumulative counters and timestamps in its
frames, and this module turns them into histograms, counters and gauges labelled by model_name.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import HistogramMetricFamily

from engine.messages import EngineStats

CONTENT_TYPE = CONTENT_TYPE_LATEST
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
FINISH_REASONS = ("stop", "length", "abort", "error")
REJECT_REASONS = ("queue_full", "shutting_down")  # 503s from admission control and from a draining server


class LoopHistogram:
    """A histogram observed and rendered on the event loop only, so it needs no lock: one bisect per
    observation (prometheus_client's Histogram takes a lock for the sum and one for the bucket, which
    showed up in the API CPU per token for the per-token ITL; bench/README.md)."""

    __slots__ = ("counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(LATENCY_BUCKETS, value)] += 1  # le semantics: value <= bound
        self.sum += value


class _Histograms:
    """The registry's view of the LoopHistograms: standard histogram families labelled by model_name."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.items: list[tuple[str, str, LoopHistogram]] = []

    def collect(self) -> Iterator[HistogramMetricFamily]:
        bounds = [repr(float(b)) for b in LATENCY_BUCKETS] + ["+Inf"]  # as prometheus_client prints them
        for name, doc, hist in self.items:
            family = HistogramMetricFamily(name, doc, labels=["model_name"])
            cumulative, buckets = 0, []
            for bound, count in zip(bounds, hist.counts):
                cumulative += count
                buckets.append((bound, cumulative))
            family.add_metric([self.model_name], buckets, hist.sum)
            yield family


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        label = ["model_name"]

        histograms = _Histograms(model_name)
        self.registry.register(histograms)

        def hist(name: str, doc: str) -> LoopHistogram:
            histograms.items.append((name, doc, LoopHistogram()))
            return histograms.items[-1][2]

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, label, registry=self.registry).labels(model_name)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, label, registry=self.registry).labels(model_name)

        self.ttft = hist("spindle_time_to_first_token_seconds", "Arrival to first token.")
        self.itl = hist("spindle_inter_token_latency_seconds", "Time between engine steps' tokens.")
        self.tpot = hist("spindle_time_per_output_token_seconds", "Decode time per output token.")
        self.e2e = hist("spindle_e2e_request_latency_seconds", "Arrival to finish.")
        self.queue = hist("spindle_request_queue_time_seconds", "Arrival to first schedule.")
        self.prefill = hist("spindle_request_prefill_time_seconds", "First schedule to first token.")
        self.decode = hist("spindle_request_decode_time_seconds", "First token to finish.")
        self.prompt_tokens = counter("spindle_prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("spindle_generation_tokens", "Generated tokens.")
        success = Counter("spindle_request_success", "Finished requests by finish reason.",
                          ["model_name", "finished_reason"], registry=self.registry)
        self.finished = {r: success.labels(model_name, r) for r in FINISH_REASONS}
        self.preemptions = counter("spindle_num_preemptions", "Preemptions in the engine.")
        self.cache_queries = counter("spindle_prefix_cache_queries", "Prompt tokens looked up.")
        self.cache_hits = counter("spindle_prefix_cache_hits", "Prompt tokens found cached.")
        # images (a vision model): the image worker's processor cache, the API's mirror of the engine's encoder
        # cache (images sent by hash; misses resent with pixels) and the engine's own encoder-cache hits
        self.mm_processor_cache_hits = counter("spindle_mm_processor_cache_hits",
                                               "Images whose preprocessing the image worker's cache held.")
        self.mm_engine_cache_hits = counter("spindle_mm_engine_cache_hits",
                                            "Images sent to the engine by hash only (the mirror said it held them).")
        self.mm_engine_cache_misses = counter("spindle_mm_engine_cache_misses",
                                              "Requests sent by hash the engine no longer held, resent with pixels.")
        self.mm_encoder_cache_hits = counter("spindle_mm_encoder_cache_hits",
                                             "Images whose vision-encoder output the engine had cached.")
        rejected = Counter("spindle_requests_rejected", "Requests refused with 503 before reaching the engine.",
                           ["model_name", "reason"], registry=self.registry)
        self._rejected = {r: rejected.labels(model_name, r) for r in REJECT_REASONS}  # exported at 0 from the start
        self.running = gauge("spindle_num_requests_running", "Requests in the engine's running set.")
        self.waiting = gauge("spindle_num_requests_waiting", "Requests waiting in the engine.")
        self.kv_usage = gauge("spindle_kv_cache_usage_perc",
                              "Fraction of KV blocks held by requests (0..1).")
        self._last = EngineStats(0, 0, 0, 1, 0, 0, 0)

    def record_stats(self, stats: EngineStats) -> None:
        """Gauges from the latest engine stats; engine counters are cumulative, so add the delta."""
        last, self._last = self._last, stats
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.num_used_blocks / max(stats.num_total_blocks, 1))
        for counter, now, before in ((self.preemptions, stats.num_preemptions, last.num_preemptions),
                                     (self.cache_queries, stats.prefix_cache_queries, last.prefix_cache_queries),
                                     (self.cache_hits, stats.prefix_cache_hits, last.prefix_cache_hits),
                                     (self.mm_encoder_cache_hits, stats.image_cache_hits, last.image_cache_hits)):
            if now > before:
                counter.inc(now - before)

    def record_finished(self, *, reason: str, arrival: float, scheduled: float, first_token: float,
                        finished: float, num_prompt_tokens: int, num_output_tokens: int) -> None:
        self.finished[reason if reason in self.finished else "error"].inc()
        self.prompt_tokens.inc(num_prompt_tokens)
        if arrival:
            self.e2e.observe(max(finished - arrival, 0.0))
        if scheduled and arrival:
            self.queue.observe(max(scheduled - arrival, 0.0))
        if first_token and scheduled:
            self.prefill.observe(max(first_token - scheduled, 0.0))
        if first_token:
            self.decode.observe(max(finished - first_token, 0.0))
            if num_output_tokens > 1:
                self.tpot.observe(max(finished - first_token, 0.0) / (num_output_tokens - 1))

    def rejected(self, reason: str) -> None:
        self._rejected[reason].inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
