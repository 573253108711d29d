"""--models-dir's /metrics: every model's own metrics (each labelled by its model_name) as one family per name.

A model's counters and histograms outlive its unloads, as Prometheus needs of a counter (it only grows): at each
unload what they reached is kept, shown while the model is unloaded and added to its next load's own. Its gauges
(running, waiting, KV usage, the engine's heartbeat age) describe a live engine and go with it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

CUMULATIVE = frozenset({"counter", "histogram", "summary"})
LabelKey = tuple[str, tuple[tuple[str, str], ...]]


def _key(sample: Sample) -> LabelKey:
    return sample.name, tuple(sorted(sample.labels.items()))


def add(kept: Metric, live: Metric) -> Metric:
    """`live` with `kept` added sample by sample (a `_created` sample keeps the earlier time); samples that only
    `kept` has (a label set not seen since the load) come after."""
    before = {_key(s): s for s in kept.samples}
    family = Metric(live.name, live.documentation, live.type, live.unit)
    for sample in live.samples:
        old = before.pop(_key(sample), None)
        if old is None:
            family.samples.append(sample)
        elif sample.name.endswith("_created"):
            family.samples.append(sample._replace(value=min(old.value, sample.value)))
        else:
            family.samples.append(sample._replace(value=old.value + sample.value))
    family.samples.extend(before.values())
    return family


def cumulative(families: Iterable[Metric]) -> dict[str, Metric]:
    return {family.name: family for family in families if family.type in CUMULATIVE}


class PerModelMetrics(Collector):
    """`slots`: the registry's, by name; each loaded slot's `loaded.metrics.registry` is collected."""

    def __init__(self, slots: Mapping[str, Any]) -> None:
        self.slots = slots
        self.kept: dict[str, dict[str, Metric]] = {}  # model -> its counters and histograms at its last unload

    def keep(self, slot: Any) -> None:
        """At a model's unload (its requests are over): keep what its counters and histograms reached."""
        if slot.loaded is None or slot.loaded.metrics is None:
            return
        self.kept[slot.name] = self._of(slot.name, cumulative(slot.loaded.metrics.registry.collect()))

    def _of(self, name: str, live: dict[str, Metric]) -> dict[str, Metric]:
        """A model's families: its live ones with what was kept from its earlier loads added."""
        kept = self.kept.get(name, {})
        out = {n: add(kept[n], family) if n in kept else family for n, family in live.items()}
        out.update((n, family) for n, family in kept.items() if n not in out)
        return out

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for name, slot in self.slots.items():
            metrics = slot.loaded.metrics if slot.loaded is not None else None
            live = {f.name: f for f in metrics.registry.collect()} if metrics is not None else {}
            for family in self._of(name, live).values():
                into = merged.get(family.name)
                if into is None:
                    into = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                into.samples.extend(family.samples)
        yield from merged.values()
