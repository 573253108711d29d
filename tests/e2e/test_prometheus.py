"""The Grafana dashboard against a real Prometheus (the distribution's `prometheus`; .ci/run installs it) scraping a
real spindle: every PromQL expression of deploy/grafana/*.json, with each value of its `prefix` variable, parses and
returns data after some traffic, so a metric renamed in code fails here. The scrape config is deploy/prometheus.yml
with the test's target and a 1 s interval.

The server runs --data-parallel-size 2 (the per-engine panels need two engines), --metrics-compat vllm (the
`vllm:` value of the prefix variable) and one LoRA adapter (the per-adapter panel).
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import yaml

from tests.dashboards import DASHBOARDS, PROMETHEUS_EXAMPLE, expressions, fill, label_values, load, prefixes, variables
from tests.e2e.conftest import Server, free_port, start_server
from tests.helpers.lora import write_adapter

MODEL = "tiny"
# the draft acceptance panel: one-token lookups find a match in any prompt that repeats a token
SPEC = '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2, "prompt_lookup_min": 1}'
ADAPTER = "tiny-lora"
T = TypeVar("T")


def binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"no `{name}` for the Prometheus test: `apt-get install prometheus` (.ci/run does)")
    return path


def until(what: str, probe: Callable[[], T | None], timeout: float = 60) -> T:
    """Poll `probe` until it returns something (bounded; Prometheus scrapes every second)."""
    deadline = time.monotonic() + timeout
    while (found := probe()) is None:
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.2)
    return found


@dataclass
class Prometheus:
    url: str

    def query(self, promql: str) -> dict[str, Any]:
        r = httpx.get(f"{self.url}/api/v1/query", params={"query": promql}, timeout=30)
        body = dict(r.json())
        assert r.status_code == 200 and body["status"] == "success", f"{promql}: {r.status_code} {body}"
        return body

    def values(self, promql: str) -> list[float]:
        data = self.query(promql)["data"]
        assert data["resultType"] == "vector", data
        return [float(s["value"][1]) for s in data["result"]]


@pytest.fixture(scope="module")
def spindle(qwen2_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("prom-spindle")
    adapter = write_adapter(qwen2_ckpt, tmp / "adapter", r=8, targets=["q_proj", "v_proj"], seed=5)
    s = start_server(
        qwen2_ckpt,
        tmp,
        "--data-parallel-size",
        "2",
        "--metrics-compat",
        "vllm",
        "--enable-lora",
        "--lora-modules",
        f"{ADAPTER}={adapter}",
        "--speculative-config",
        SPEC,
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def prometheus(spindle: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    tmp = tmp_path_factory.mktemp("prometheus")
    config = yaml.safe_load(PROMETHEUS_EXAMPLE.read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["scrape_configs"][0]["static_configs"] = [{"targets": [f"127.0.0.1:{spindle.port}"]}]
    (tmp / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    port = free_port()
    log = tmp / "prometheus.log"
    proc = subprocess.Popen(
        [
            binary("prometheus"),
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    prom = Prometheus(f"http://127.0.0.1:{port}")

    def ready() -> bool | None:
        assert proc.poll() is None, f"prometheus exited {proc.returncode}:\n{log.read_text()[-3000:]}"
        try:
            return httpx.get(f"{prom.url}/-/ready", timeout=2).status_code == 200 or None
        except httpx.TransportError:
            return None

    try:
        until("prometheus to be ready", ready)
        yield prom
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_example_scrape_config_is_valid() -> None:
    out = subprocess.run(
        [binary("promtool"), "check", "config", str(PROMETHEUS_EXAMPLE)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr


def traffic(server: Server) -> None:
    """Streamed and plain chats, concurrent (both engines get work), one long prompt twice (prefix-cache hits)."""
    long = "Spindles turn fibre into yarn, one twist at a time; " * 6

    def chat(i: int) -> None:
        body = {
            "model": MODEL,
            "max_tokens": 6,
            "temperature": 0,
            "ignore_eos": True,
            "stream": i % 2 == 0,
            "messages": [{"role": "user", "content": f"request {i}: tell me a story"}],
        }
        r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(chat, range(8)))
    r = httpx.post(
        f"{server.url}/v1/completions",
        timeout=120,
        json={"model": ADAPTER, "prompt": "hello", "max_tokens": 2, "ignore_eos": True},
    )
    assert r.status_code == 200, r.text
    r = httpx.post(
        f"{server.url}/v1/completions",
        timeout=120,
        json={"model": MODEL, "prompt": "one two three " * 8, "max_tokens": 8, "ignore_eos": True, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    for _ in range(2):
        r = httpx.post(
            f"{server.url}/v1/completions",
            timeout=120,
            json={"model": MODEL, "prompt": long, "max_tokens": 4, "ignore_eos": True},
        )
        assert r.status_code == 200, r.text


def scraped(prom: Prometheus, promql: str, want: float) -> bool | None:
    values = prom.values(promql)
    return True if values and values[0] == want else None


def test_every_dashboard_expression_returns_data(spindle: Server, prometheus: Prometheus) -> None:
    until("spindle's first scrape", lambda: scraped(prometheus, 'up{job="spindle"}', 1.0))
    traffic(spindle)
    hits = spindle.metric("spindle_prefix_cache_hits_total")
    assert hits > 0  # the long prompt's second request
    generated = spindle.metric("spindle_generation_tokens_total")
    until(
        "the traffic to be scraped",
        lambda: scraped(prometheus, f'sum(spindle_generation_tokens_total{{model_name="{MODEL}"}})', generated),
    )
    pending = {
        fill(expr, prefix=prefix, model=MODEL): f"{path.name}: {title}"
        for path in DASHBOARDS
        for title, expr in expressions(load(path))
        for prefix in prefixes(expr)
    }
    assert len(pending) >= 40
    failures = _evaluate(prometheus, pending)
    for path in DASHBOARDS:
        _check_variables(prometheus, load(path), failures)
    assert failures == {}


def test_every_metric_a_dashboard_names_is_exported(spindle: Server) -> None:
    """Each name a query reads (both values of the prefix variable) is a family in /metrics, e.g. the draft
    acceptance rate's spec_decode_num_accepted_tokens_total and spec_decode_num_draft_tokens_total."""
    traffic(spindle)
    text = httpx.get(f"{spindle.url}/metrics", timeout=10).text
    exported = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    named = {
        name
        for path in DASHBOARDS
        for _, expr in expressions(load(path))
        for prefix in prefixes(expr)
        for name in re.findall(r"([A-Za-z_:][\w:]*)\{", fill(expr, prefix=prefix, model=MODEL))  # selectors
    }
    assert {"spindle_spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_draft_tokens_total"} <= named
    assert named - exported == set()
    assert spindle.metric("spindle_spec_decode_num_draft_tokens_total") > 0  # the traffic drafted


def _evaluate(prom: Prometheus, pending: dict[str, str], timeout: float = 30) -> dict[str, str]:
    """Each query until it gives a number (a rate needs two scrapes after the traffic); what never did, and why."""
    why: dict[str, str] = {}
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        for promql in list(pending):
            try:
                values = prom.values(promql)
            except AssertionError as e:  # Prometheus refused it: a parse error does not go away
                why[promql] = str(e)
                continue
            if any(not math.isnan(v) for v in values):
                del pending[promql]
            else:
                why[promql] = f"no data: {values}"
        time.sleep(0.5)
    return {f"{where}: {promql}": why.get(promql, "") for promql, where in pending.items()}


def _check_variables(prom: Prometheus, dash: dict[str, Any], failures: dict[str, str]) -> None:
    """The model picker's label_values() query finds the served model under either metric prefix."""
    query = variables(dash)["model_name"]["query"]
    metric, label = label_values(query["query"] if isinstance(query, dict) else query)
    for prefix in prefixes(metric):
        name = fill(metric, prefix=prefix, model=MODEL)
        r = httpx.get(f"{prom.url}/api/v1/label/{label}/values", params={"match[]": name}, timeout=30)
        if MODEL not in r.json().get("data", []):
            failures[f"variable model_name with {name}"] = r.text[:300]


def test_a_renamed_metric_would_fail(prometheus: Prometheus) -> None:
    """The check above can fail: a name nothing exports parses and returns no data."""
    assert (
        prometheus.values(
            fill(
                'sum(rate(${prefix}no_such_metric_total{model_name=~"$model_name"}[$__rate_interval]))',
                prefix="spindle_",
                model=MODEL,
            )
        )
        == []
    )
