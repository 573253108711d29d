"""Prometheus metrics, recorded in the API server from the engine's timestamps.

The engine core never touches Prometheus: it reports cumulative counters and timestamps in its
frames, and this module turns them into histograms, counters and gauges labelled by model_name.

Counters and histograms are this module's own (written on the event loop only, so no lock), rendered by
collectors through prometheus_client's public families: their numbers live in `MetricSlots`, a row of
doubles that `ServerMetrics.share` can move into memory every API process maps (server/shared_state.py),
so each process's /metrics shows the sums over all of them. Gauges are prometheus_client's own.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.messages import EngineStats
from server.lora.adapter_metrics import LoRAMetrics
from server.metrics.slots import LATENCY_BUCKETS, LoopCounter, LoopHistogram, MetricSlots, Placed

CONTENT_TYPE = CONTENT_TYPE_LATEST
FINISH_REASONS = ("stop", "length", "abort", "error")
REJECT_REASONS = ("queue_full", "shutting_down")  # 503s from admission control and from a draining server
# Why a best-effort structured answer failed its whole schema (server/structured/output_check.py): the keyword that
# failed (the relaxed one it sits under, where there is one); "not_json": not JSON at all; "other": any other keyword.
STRUCTURED_INVALID_REASONS = (
    "not_json",
    "oneOf",
    "anyOf",
    "allOf",
    "not",
    "if",
    "uniqueItems",
    "propertyNames",
    "dependencies",
    "dependentRequired",
    "dependentSchemas",
    "minProperties",
    "maxProperties",
    "contains",
    "unevaluatedProperties",
    "unevaluatedItems",
    "format",
    "pattern",
    "patternProperties",
    "required",
    "additionalProperties",
    "type",
    "enum",
    "const",
    "other",
)


class _Histograms(Collector):
    """The registry's view of the histograms: standard histogram families labelled by model_name."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.items: list[tuple[str, str, LoopHistogram]] = []

    def collect(self) -> Iterator[Metric]:
        bounds = [repr(float(b)) for b in LATENCY_BUCKETS] + ["+Inf"]  # as prometheus_client prints them
        for name, doc, hist in self.items:
            family = HistogramMetricFamily(name, doc, labels=["model_name"])
            cumulative, buckets = 0, []
            for bound, count in zip(bounds, hist.counts):
                cumulative += count
                buckets.append((bound, cumulative))
            family.add_metric([self.model_name], buckets, hist.sum)
            yield family


class _CounterFamily:
    """One counter family: its label names and a LoopCounter per label values."""

    def __init__(self, name: str, doc: str, labels: list[str]) -> None:
        self.name = name
        self.doc = doc
        self.labels = labels
        self.children: dict[tuple[str, ...], LoopCounter] = {}


class _Counters(Collector):
    """The registry's view of the counters, rendered as prometheus_client renders its Counter (`_total`,
    `_created`)."""

    def __init__(self, created: float) -> None:
        self.created = created
        self.families: list[_CounterFamily] = []

    def collect(self) -> Iterator[Metric]:
        for fam in self.families:
            family = CounterMetricFamily(fam.name, fam.doc, labels=fam.labels)
            for values, counter in fam.children.items():
                family.add_metric(list(values), counter.get(), created=self.created)
            yield family


class _PerProcess(Collector):
    """spindle_api_server_requests{api_server}: finished requests per API process (where requests land)."""

    def __init__(self, model_name: str, finished: list[LoopCounter]) -> None:
        self.model_name = model_name
        self.finished = finished

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "spindle_api_server_requests",
            "Finished requests by API server process.",
            labels=["model_name", "api_server"],
        )
        rows = [c.per_process() for c in self.finished]
        for p, values in enumerate(zip(*rows)):
            family.add_metric([self.model_name, str(p)], sum(values))
        yield family


class _HeartbeatAge(Collector):
    """spindle_engine_heartbeat_age_seconds: how long since the engine was last heard from, at scrape time."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "spindle_engine_heartbeat_age_seconds",
            "Seconds since the engine's last frame (steps, or a heartbeat every 0.5 s).",
            labels=["model_name"],
        )
        family.add_metric([self.metrics.model_name], max(time.monotonic() - self.metrics.engine_heard, 0.0))
        yield family


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self._slots = MetricSlots.private()  # request counters and histograms: `share` moves them
        self._engine_slots = MetricSlots.private()  # counters from the engine's totals: each process has them
        self._request_values: list[Placed] = []  # what `share` moves, in the same order in every process
        self._histograms = _Histograms(model_name)
        self.registry.register(self._histograms)
        self._counters = _Counters(time.time())
        self.registry.register(self._counters)
        self._latency_histograms()
        self._request_counters()
        self._engine_counters()
        self._image_counters()
        self._spec_counters()
        self._rejected_counters()
        self._structured_counters()
        self._engine_gauges()
        self._last = EngineStats(0, 0, 0, 1, 0, 0, 0)
        self.engine_heard = time.monotonic()  # when the last engine frame's stats came (record_stats)
        self.lora: LoRAMetrics | None = None  # --enable-lora (enable_lora)

    def _latency_histograms(self) -> None:
        """Per-request latencies, from arrival to finish."""
        hist = self._histogram
        self.ttft = hist("spindle_time_to_first_token_seconds", "Arrival to first token.")
        self.itl = hist("spindle_inter_token_latency_seconds", "Time between engine steps' tokens.")
        self.tpot = hist("spindle_time_per_output_token_seconds", "Decode time per output token.")
        self.e2e = hist("spindle_e2e_request_latency_seconds", "Arrival to finish.")
        self.queue = hist("spindle_request_queue_time_seconds", "Arrival to first schedule.")
        self.prefill = hist("spindle_request_prefill_time_seconds", "First schedule to first token.")
        self.decode = hist("spindle_request_decode_time_seconds", "First token to finish.")

    def _request_counters(self) -> None:
        """Finished requests' tokens, and the requests by finish reason."""
        counter = self._counter
        self.prompt_tokens = counter("spindle_prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("spindle_generation_tokens", "Generated tokens.")
        self.finished = self._family(
            "spindle_request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            FINISH_REASONS,
        )

    def _engine_counters(self) -> None:
        """The engine's preemptions and prefix-cache lookups."""
        counter = self._counter
        self.preemptions = counter("spindle_num_preemptions", "Preemptions in the engine.", engine=True)
        self.cache_queries = counter("spindle_prefix_cache_queries", "Prompt tokens looked up.", engine=True)
        self.cache_hits = counter("spindle_prefix_cache_hits", "Prompt tokens found cached.", engine=True)

    def _image_counters(self) -> None:
        """Image (and Whisper audio) caches of a multimodal model."""
        counter = self._counter
        # images (a vision model): the image worker's processor cache, the API's mirror of the engine's encoder
        # cache (images sent by hash; misses resent with pixels) and the engine's own encoder-cache hits
        self.mm_processor_cache_hits = counter(
            "spindle_mm_processor_cache_hits", "Images whose preprocessing the image worker's cache held."
        )
        self.mm_engine_cache_hits = counter(
            "spindle_mm_engine_cache_hits", "Images sent to the engine by hash only (the mirror said it held them)."
        )
        self.mm_engine_cache_misses = counter(
            "spindle_mm_engine_cache_misses", "Requests sent by hash the engine no longer held, resent with pixels."
        )
        self.mm_encoder_cache_hits = counter(
            "spindle_mm_encoder_cache_hits",
            "Images (or Whisper audio windows) whose encoder output the engine had cached.",
            engine=True,
        )

    def _spec_counters(self) -> None:
        """--speculative-config (engine/spec/): verifications, draft tokens, accepted ones, accepted per position."""
        counter = self._counter
        self.spec_drafts = counter(
            "spindle_spec_decode_num_drafts",
            "Speculative verifications: one per sequence and step with a draft.",
            engine=True,
        )
        self.spec_draft_tokens = counter("spindle_spec_decode_num_draft_tokens", "Draft tokens verified.", engine=True)
        self.spec_accepted = counter("spindle_spec_decode_num_accepted_tokens", "Draft tokens accepted.", engine=True)
        self._spec_per_pos = _CounterFamily(
            "spindle_spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft (0: the first).",
            ["model_name", "position"],
        )
        self._counters.families.append(self._spec_per_pos)

    def _rejected_counters(self) -> None:
        """Requests refused before reaching the engine, by reason."""
        self._rejected = self._family(  # exported at 0 from the start
            "spindle_requests_rejected",
            "Requests refused with 503 before reaching the engine.",
            ["model_name", "reason"],
            REJECT_REASONS,
        )

    def _structured_counters(self) -> None:
        """Best-effort structured-output answers checked against their whole schema."""
        counter = self._counter
        self.structured_checked_answers = counter(
            "spindle_structured_output_checked",
            "Answers of best-effort (relaxed) structured-output constraints validated against their whole schema.",
        )
        self._structured_invalid = self._family(
            "spindle_structured_output_invalid",
            "Best-effort structured answers that failed their whole schema, by the keyword that failed.",
            ["model_name", "reason"],
            STRUCTURED_INVALID_REASONS,
        )

    def _engine_gauges(self) -> None:
        """The engine's running and waiting requests and KV-cache use."""
        self.running = self._gauge("spindle_num_requests_running", "Requests in the engine's running set.")
        self.waiting = self._gauge("spindle_num_requests_waiting", "Requests waiting in the engine.")
        self.kv_usage = self._gauge("spindle_kv_cache_usage_perc", "Fraction of KV blocks held by requests (0..1).")

    def enable_lora(self, max_loras: int) -> None:
        self.lora = LoRAMetrics(self.model_name, max_loras)
        self.registry.register(self.lora)

    def lora_request(self, name: str, n: int) -> None:
        if self.lora is not None:
            self.lora.record_request(name, n)

    def _histogram(self, name: str, doc: str) -> LoopHistogram:
        h = LoopHistogram(self._slots)
        self._histograms.items.append((name, doc, h))
        self._request_values.append(h)
        return h

    def _family(
        self, name: str, doc: str, labels: list[str], values: tuple[str, ...] = ("",), engine: bool = False
    ) -> dict[str, LoopCounter]:
        """A counter family with one child per value of its second label (or one child, ""); `engine`: counts
        from the engine's totals, kept in this process."""
        fam = _CounterFamily(name, doc, labels)
        self._counters.families.append(fam)
        made = {}
        for v in values:
            c = made[v] = LoopCounter(self._engine_slots if engine else self._slots)
            fam.children[(self.model_name, v) if len(labels) > 1 else (self.model_name,)] = c
            if not engine:
                self._request_values.append(c)
        return made

    def _counter(self, name: str, doc: str, engine: bool = False) -> LoopCounter:
        return self._family(name, doc, ["model_name"], engine=engine)[""]

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(name, doc, ["model_name"], registry=self.registry).labels(self.model_name)

    def share(self, slots: MetricSlots) -> None:
        """Move the request counters and histograms into `slots` (rows every API process maps), so /metrics
        shows the sums over all processes, and add spindle_api_server_requests. Counters from the engine's
        stats stay in this process: each process gets the same engine stats (gauges as reported, counters from
        the engine's cumulative totals), so they are reported once, not N times."""
        for value in self._request_values:
            value.move_to(slots)
        self._slots = slots
        self.registry.register(_PerProcess(self.model_name, list(self.finished.values())))

    def watch_engine(self) -> None:
        """Export the engine's heartbeat age (a full server: `spindle render` has no engine to watch)."""
        self.engine_heard = time.monotonic()
        self.registry.register(_HeartbeatAge(self))

    def record_stats(self, stats: EngineStats) -> None:
        """Gauges from the latest engine stats (every engine frame has them); engine counters are cumulative, so
        add the delta."""
        self.engine_heard = time.monotonic()
        last, self._last = self._last, stats
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.num_used_blocks / max(stats.num_total_blocks, 1))
        if self.lora is not None:
            self.lora.record_stats(stats)
        for counter, now, before in (
            (self.preemptions, stats.num_preemptions, last.num_preemptions),
            (self.cache_queries, stats.prefix_cache_queries, last.prefix_cache_queries),
            (self.cache_hits, stats.prefix_cache_hits, last.prefix_cache_hits),
            (self.mm_encoder_cache_hits, stats.image_cache_hits, last.image_cache_hits),
            (self.spec_drafts, stats.spec_num_drafts, last.spec_num_drafts),
            (self.spec_draft_tokens, stats.spec_num_draft_tokens, last.spec_num_draft_tokens),
            (self.spec_accepted, stats.spec_num_accepted_tokens, last.spec_num_accepted_tokens),
        ):
            if now > before:
                counter.inc(now - before)
        self._record_per_pos(stats.spec_accepted_per_pos, last.spec_accepted_per_pos)

    def _record_per_pos(self, now: list[int], before: list[int]) -> None:
        """spec_decode_num_accepted_tokens_per_pos: a child per draft position, made when the engine first
        reports it."""
        children = self._spec_per_pos.children
        for i, count in enumerate(now):
            key = (self.model_name, str(i))
            if key not in children:
                children[key] = LoopCounter(self._engine_slots)
            gained = count - (before[i] if i < len(before) else 0)
            if gained > 0:
                children[key].inc(gained)

    def record_finished(
        self,
        *,
        reason: str,
        arrival: float,
        scheduled: float,
        first_token: float,
        finished: float,
        num_prompt_tokens: int,
        num_output_tokens: int,
    ) -> None:
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

    def structured_checked(self, reason: str | None) -> None:
        """One relaxed answer validated: None when it satisfied its whole schema, else why not."""
        self.structured_checked_answers.inc()
        if reason is not None:
            self._structured_invalid.get(reason, self._structured_invalid["other"]).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
