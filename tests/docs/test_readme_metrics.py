"""docs/operations.md's metrics table against what /metrics exports: every family listed, nothing listed that is not
exported.

The app is the real one (routes, lifespan, metrics registry) over real HTTP, with fake engines, as
tests/server/test_app.py serves it; two engines (--data-parallel-size 2) so the per-engine families exist too,
--enable-lora for the LoRA families, and --metrics-compat vllm so the vllm:* names the page quotes can be
checked.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from hypercorn.config import Config
from prometheus_client.parser import text_string_to_metric_families

from demo.tokenizers import tokenizer_dir
from engine.messages import AddRequest
from server.app import create_app
from server.config import ServerConfig
from tests.server.fake_engine import FakeEngineClient

OPERATIONS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


def _no_tokens(req: AddRequest) -> list[int]:
    return []  # no request is sent: only the exported families matter


async def _fresh_fake(config: Any) -> AsyncIterator[FakeEngineClient]:
    yield FakeEngineClient(_no_tokens)  # one per engine of the pool, as real engines are


def scrape(**config: Any) -> str:
    """GET /metrics from create_app(...) under Hypercorn's trio worker in a portal thread, fake engines."""
    import hypercorn.trio

    cfg = ServerConfig.from_settings(
        **{"model": str(tokenizer_dir("qwen2")), "served_model_name": "tiny", "sse_keepalive": 0, **config}
    )
    app = create_app(cfg, engine_factory=asynccontextmanager(_fresh_fake))
    hc = Config()
    hc.bind = ["127.0.0.1:0"]
    hc.accesslog = None
    hc.graceful_timeout = 1
    with anyio.from_thread.start_blocking_portal(backend="trio") as portal:
        stop = portal.call(anyio.Event)
        future, binds = portal.start_task(
            lambda task_status: hypercorn.trio.serve(app, hc, shutdown_trigger=stop.wait, task_status=task_status)
        )
        try:
            r = httpx.get(binds[0] + "/metrics", timeout=30)
            assert r.status_code == 200
            return r.text
        finally:
            portal.call(stop.set)
            future.result(timeout=30)


def exported_families(text: str) -> dict[str, str]:
    """Family name -> type, counters with the `_total` their samples carry (the name the page uses).
    A counter's `_created` timestamp (prometheus_client's, parsed as a gauge of its own) belongs to the counter."""
    families = {f.name: f.type for f in text_string_to_metric_families(text)}
    counters = {n for n, t in families.items() if t == "counter"}
    return {
        n + ("_total" if t == "counter" else ""): t
        for n, t in families.items()
        if not (n.endswith("_created") and n.removesuffix("_created") in counters)
    }


def metrics_section() -> str:
    text = OPERATIONS.read_text()
    start = text.index("## Metrics (`GET /metrics`")
    return text[start : text.index("\n## ", start + 1)]


def doc_table() -> dict[str, str]:
    """Metric name -> type from the page's table rows: each backquoted name in the first column."""
    table: dict[str, str] = {}
    for line in metrics_section().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        for name in re.findall(r"`([a-z0-9_:]+)(?:\{[a-z_, ]+\})?`", cells[0]):
            table[name] = cells[1]
    return table


@pytest.fixture(scope="module")
def metrics_text(qwen2_ckpt: Path) -> Iterator[str]:
    # a checkpoint with its config.json: --enable-lora reads the base's sizes (its families exist then)
    yield scrape(model=str(qwen2_ckpt), data_parallel_size=2, metrics_compat="vllm", enable_lora=True)


def test_metrics_table_lists_every_exported_family(metrics_text: str) -> None:
    exported = {n: t for n, t in exported_families(metrics_text).items() if n.startswith("spindle_")}
    table = doc_table()
    assert exported, metrics_text
    assert sorted(set(exported) - set(table)) == [], "exported but missing from docs/operations.md's metrics table"
    assert sorted(set(table) - set(exported)) == [], "in docs/operations.md's metrics table but not exported"
    assert {n: table[n] for n in exported} == exported, "docs/operations.md's type column differs from the exposition"


def test_metrics_table_labels_are_exported(metrics_text: str) -> None:
    """A `name{label}` in the table: every sample of that family carries the label."""
    labelled = re.findall(r"`([a-z_]+)\{([a-z_, ]+)\}`", metrics_section())
    assert labelled
    samples = [s for f in text_string_to_metric_families(metrics_text) for s in f.samples]
    for name, labels in labelled:
        own = [s for s in samples if s.name == name]
        assert own, name
        for label in labels.split(","):
            assert all(label.strip() in s.labels for s in own), (name, label)


def test_quoted_vllm_names_are_exported(metrics_text: str) -> None:
    quoted = set(re.findall(r"`(vllm:[a-z_]+)`", metrics_section()))
    assert quoted
    assert sorted(quoted - set(exported_families(metrics_text))) == []
