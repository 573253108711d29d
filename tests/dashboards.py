"""The Grafana dashboards in deploy/grafana/: their PromQL expressions and variables, filled in as Grafana fills them,
for tests/docs/test_dashboards.py (structure) and tests/e2e/test_prometheus.py (evaluated by a real Prometheus)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DASHBOARDS = sorted((ROOT / "deploy" / "grafana").glob("*.json"))
PROMETHEUS_EXAMPLE = ROOT / "deploy" / "prometheus.yml"
PREFIXES = ("spindle_", "vllm:")  # the `prefix` variable's values: spindle's names, or --metrics-compat vllm's


def load(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, those inside collapsed rows too."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def expressions(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every query target."""
    return [(p["title"], t["expr"]) for p in panels(dashboard) for t in p.get("targets", [])]


def variables(dashboard: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in dashboard["templating"]["list"]}


def fill(expr: str, *, prefix: str, model: str, rate_interval: str = "1m") -> str:
    """The query Grafana would send with these variable values."""
    out = expr.replace("${prefix}", prefix).replace("$prefix", prefix)
    out = out.replace("$__rate_interval", rate_interval).replace("${model_name}", model).replace("$model_name", model)
    assert "$" not in out, f"a variable the tests do not fill: {out}"
    return out


def prefixes(expr: str) -> tuple[str, ...]:
    """The `prefix` values an expression is evaluated with (one when it names spindle-only metrics directly)."""
    return PREFIXES if re.search(r"\$\{?prefix\}?", expr) else PREFIXES[:1]


def label_values(query: str) -> tuple[str, str]:
    """`label_values(metric, label)` -> (metric, label)."""
    m = re.fullmatch(r"\s*label_values\(\s*([^,\s]+)\s*,\s*(\w+)\s*\)\s*", query)
    assert m, query
    return m.group(1), m.group(2)
