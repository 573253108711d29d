"""--metrics-compat vllm: the metrics routers read, also under vLLM's names.

Routers and autoscalers written for vLLM (llm-d's inference scheduler, the vLLM production-stack router,
KEDA rules, Grafana boards) scrape `vllm:*` names with `model_name` and `engine` labels. With this option
/metrics carries, beside every spindle_* family, a copy named as vLLM v1 names it (vllm/v1/metrics/loggers.py):
the same type, the same samples, `engine="0"` added. The copy is made at scrape time from the families
already collected, so nothing extra runs per request.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector, CollectorRegistry

# spindle_<name> -> vllm:<name>; the same suffix in both, as vLLM spells it (types: gauge, counter, histogram).
VLLM_NAMES = (
    "num_requests_running",
    "num_requests_waiting",
    "kv_cache_usage_perc",  # gauges
    "prefix_cache_queries",
    "prefix_cache_hits",
    "num_preemptions",  # counters
    "prompt_tokens",
    "generation_tokens",
    "request_success",  # counters (request_success: finished_reason)
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "time_per_output_token_seconds",  # histograms
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
    "lora_requests_info",
    "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",  # counters
    "spec_decode_num_accepted_tokens_per_pos",
)
_RENAMED = {f"spindle_{n}": f"vllm:{n}" for n in VLLM_NAMES}


class VllmNames(Collector):
    """Yields vLLM-named copies of the registry's spindle families. Registered in that same registry, it
    collects the others by calling the registry back, and yields nothing from inside that call."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._inside = False

    def collect(self) -> Iterator[Metric]:
        if self._inside:  # the registry's collect() calling us back
            return
        self._inside = True
        try:
            families = list(self.registry.collect())
        finally:
            self._inside = False
        for family in families:
            name = _RENAMED.get(family.name)
            if name is None:
                continue
            copy = Metric(name, family.documentation, family.type, family.unit)
            for s in family.samples:
                copy.add_sample(
                    name + s.name[len(family.name) :], {**s.labels, "engine": "0"}, s.value, s.timestamp, s.exemplar
                )
            yield copy

    def describe(self) -> Iterator[Metric]:
        return iter(())  # no names up front: the registry must not call collect() at registration


def export_vllm_names(metrics: Any) -> None:
    """Add the vLLM-named copies to a server.metrics.prometheus.ServerMetrics' registry."""
    metrics.registry.register(VllmNames(metrics.registry))
