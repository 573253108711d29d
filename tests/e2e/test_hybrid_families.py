"""The real server on each hybrid recurrent family (LFM2, Qwen3.5, Granite 4.0-H): a prompt longer than
--max-num-batched-tokens (chunked prefill through the recurrent layers) answers with transformers' greedy tokens,
n = 2 gives both choices those tokens, and the KV-usage gauge falls back to zero with the state pool; a 200-token
shared prefix hits the prefix cache by default; n-gram speculation gives the plain tokens."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file, save_file

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


def test_a_200_token_prefix_hits_by_default(hybrid: tuple[Path, Server]) -> None:
    """Default snapshot settings: the second and third prompts sharing 200 tokens (each its own tail) resume at
    192 (twelve 16-token blocks), as the prefix-cache counters on /metrics say, with transformers' tokens."""
    ckpt, srv = hybrid
    prefix = [(104_729 * i) % 30_000 + 100 for i in range(200)]
    hits = srv.metric("spindle_prefix_cache_hits_total")
    for n, tail in enumerate(([11, 12, 13], [21, 22, 23, 24, 25], [31, 32])):
        body = {"model": "tiny", "prompt": prefix + tail, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{srv.url}/v1/completions", json={**body, "return_token_ids": True}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == hf_greedy(ckpt, prefix + tail, 3)
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == (192 if n else 0)
    assert srv.metric("spindle_prefix_cache_hits_total") - hits == 2 * 192


def narrowed(src: Path, dst: Path) -> Path:
    """src with every embedding row but tokens 100..131 zeroed (LFM2 ties its head to them): its greedy output
    keeps to those tokens and repeats, so n-gram drafts come (and miss) on a random checkpoint."""
    if not dst.exists():
        shutil.copytree(src, dst)
        weights = load_file(str(dst / "model.safetensors"))
        embed = weights["model.embed_tokens.weight"]
        keep = embed[100:132].clone()
        embed.zero_()
        embed[100:132] = keep
        save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_speculative_decoding_gives_the_plain_tokens(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """--speculative-config ngram on a hybrid: transformers' greedy tokens, drafts verified and some rejected (the
    spec_decode counters), every state slot back in the pool."""
    base = tmp_path_factory.getbasetemp() / "hybrids"
    ckpt = narrowed(build_hybrid(base, "lfm2"), base / "lfm2_narrow")
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}'
    srv = start_server(ckpt, tmp_path, "--speculative-config", spec)
    try:
        prompt = [100 + (7 * i) % 32 for i in range(24)]
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 32, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{srv.url}/v1/completions", json={**body, "return_token_ids": True}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == hf_greedy(ckpt, prompt, 32)
        drafted = srv.metric("spindle_spec_decode_num_draft_tokens_total")
        assert drafted > srv.metric("spindle_spec_decode_num_accepted_tokens_total")  # drafts were rejected
        assert kv_usage(srv) == 0.0
    finally:
        srv.stop()
