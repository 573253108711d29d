"""deploy/grafana/*.json: importable as they are (data source chosen through a variable, nothing bound to one
Grafana), covering what issue 31 lists, with `${prefix}` only on the names --metrics-compat vllm also exports.
tests/e2e/test_prometheus.py evaluates every expression in a real Prometheus."""

from __future__ import annotations

import re

import pytest

from server.metrics.vllm_names import VLLM_NAMES
from tests.dashboards import DASHBOARDS, PROMETHEUS_EXAMPLE, ROOT, expressions, load, panels, variables

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# what the dashboard must show (issue 31): a metric for each
REQUIRED = {
    "num_requests_running",
    "num_requests_waiting",
    "kv_cache_usage_perc",
    "prefix_cache_hits_total",
    "prefix_cache_queries_total",
    "prompt_tokens_total",
    "generation_tokens_total",
    "time_to_first_token_seconds_bucket",
    "inter_token_latency_seconds_bucket",
    "e2e_request_latency_seconds_bucket",
    "request_success_total",
    "spindle_requests_rejected_total",
    "spindle_engine_heartbeat_age_seconds",
    "spindle_engine_num_requests_running",
    "spindle_engine_kv_cache_usage_perc",
    "spindle_engine_requests_routed_total",
    "spec_decode_num_accepted_tokens_total",  # issue 48: the acceptance rate
    "spec_decode_num_draft_tokens_total",
}


def test_there_is_a_dashboard() -> None:
    assert [p.name for p in DASHBOARDS] == ["spindle.json"]


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_importable_with_the_data_source_as_a_variable(path: object) -> None:
    dash = load(path)  # type: ignore[arg-type]
    assert dash["id"] is None and dash["uid"] and "spindle" in dash["title"]
    ds = variables(dash)["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    for panel in panels(dash):
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE and target["expr"].strip(), panel["title"]
    assert variables(dash)["model_name"]["datasource"] == DATASOURCE


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_covers_the_issue_list(path: object) -> None:
    text = " ".join(e for _, e in expressions(load(path)))  # type: ignore[arg-type]
    missing = {m for m in REQUIRED if not re.search(rf"(?:\$\{{prefix\}}|\b){re.escape(m)}\b", text)}
    assert missing == set()
    for quantile in ("0.5", "0.9", "0.99"):
        assert f"histogram_quantile({quantile}," in text


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_prefix_only_on_names_vllm_compat_exports(path: object) -> None:
    dash = load(path)  # type: ignore[arg-type]
    assert [o["value"] for o in variables(dash)["prefix"]["options"]] == ["spindle_", "vllm:"]
    for title, expr in expressions(dash):
        for name in re.findall(r"\$\{prefix\}(\w+)", expr):
            base = re.sub(r"_(total|bucket|sum|count)$", "", name)
            assert base in VLLM_NAMES, (title, name)
        assert "vllm:" not in expr, title  # the variable chooses, never the expression


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_panels_do_not_overlap(path: object) -> None:
    taken: set[tuple[int, int]] = set()
    for panel in load(path)["panels"]:  # type: ignore[arg-type]
        g = panel["gridPos"]
        cells = {(g["x"] + i, g["y"] + j) for i in range(g["w"]) for j in range(g["h"])}
        assert g["x"] + g["w"] <= 24 and not cells & taken, panel["title"]
        taken |= cells


def test_operations_page_points_at_the_dashboard_and_the_scrape_config() -> None:
    page = (ROOT / "docs" / "operations.md").read_text()
    assert "deploy/grafana/spindle.json" in page and "deploy/prometheus.yml" in page
    assert PROMETHEUS_EXAMPLE.is_file()
