"""LoRA metrics: vLLM's lora_requests_info gauge (the running and waiting adapters as labels, the value the time
of the engine stats they came from) and requests per adapter (this API process's count)."""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.messages import EngineStats


class LoRAMetrics(Collector):
    def __init__(self, model_name: str, max_loras: int) -> None:
        self.model_name, self.max_loras = model_name, max_loras
        self.running: list[str] = []
        self.waiting: list[str] = []
        self.updated = time.time()
        self.requests: dict[str, int] = {}  # adapter name -> engine requests sent under it

    def record_stats(self, stats: EngineStats) -> None:
        self.running, self.waiting, self.updated = stats.lora_running, stats.lora_waiting, time.time()

    def record_request(self, name: str, n: int) -> None:
        self.requests[name] = self.requests.get(name, 0) + n

    def collect(self) -> Iterator[Metric]:
        info = GaugeMetricFamily(
            "spindle_lora_requests_info",
            "Running and waiting LoRA adapters (vLLM's).",
            labels=["model_name", "running_lora_adapters", "waiting_lora_adapters", "max_lora"],
        )
        info.add_metric(
            [self.model_name, ",".join(self.running), ",".join(self.waiting), str(self.max_loras)], self.updated
        )
        yield info
        counts = CounterMetricFamily(
            "spindle_lora_requests", "Engine requests sent under each LoRA adapter.", labels=["model_name", "lora_name"]
        )
        for name, n in sorted(self.requests.items()):
            counts.add_metric([self.model_name, name], n)
        yield counts

    def describe(self) -> Iterator[Metric]:
        return iter(())
