"""The real server on each hybrid recurrent family (LFM2, Qwen3.5, Granite 4.0-H): a prompt longer than
--max-num-batched-tokens (chunked prefill through the recurrent layers) answers with transformers' greedy tokens,
n = 2 gives both choices those tokens, and the KV-usage gauge falls back to zero with the state pool; speculative
decoding stops start-up in one line."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import Server, start_server
from tests.engine.models.hybrid_families import build_hybrid
from tests.helpers.engine import hf_greedy

PROMPT = [(7919 * i) % 30_000 + 100 for i in range(40)]
NEW = 6


@pytest.fixture(scope="module", params=["lfm2", "qwen3_5", "granite_h"])
def hybrid(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Server]]:
    ckpt = build_hybrid(tmp_path_factory.getbasetemp() / "hybrids", str(request.param))
    srv = start_server(ckpt, tmp_path_factory.mktemp("srv"), "--max-num-batched-tokens", "16")
    yield ckpt, srv
    srv.stop()


def kv_usage(srv: Server) -> float:
    text = httpx.get(f"{srv.url}/metrics", timeout=30).text
    line = next(ln for ln in text.splitlines() if ln.startswith("spindle_kv_cache_usage_perc"))
    return float(line.split()[-1])


def test_chunked_prompt_and_n2_match_transformers(hybrid: tuple[Path, Server]) -> None:
    ckpt, srv = hybrid
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": NEW, "temperature": 0, "ignore_eos": True, "n": 2}
    r = httpx.post(f"{srv.url}/v1/completions", json={**body, "return_token_ids": True}, timeout=120)
    assert r.status_code == 200, r.text
    ref = hf_greedy(ckpt, PROMPT, NEW)
    assert [c["token_ids"] for c in r.json()["choices"]] == [ref, ref]
    assert kv_usage(srv) == 0.0  # every block and state slot back in the pool


def test_speculative_decoding_stops_startup_in_one_line(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    ckpt = build_hybrid(tmp_path_factory.getbasetemp() / "hybrids", "lfm2")
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}'
    srv = start_server(ckpt, tmp_path, "--speculative-config", spec, wait=False)
    assert srv.proc.wait(180) != 0
    log = srv.log.read_text()
    lines = [ln for ln in log.splitlines() if "--speculative-config is not supported on hybrid" in ln]
    assert len(lines) == 1 and "Traceback" not in log, log
