"""`--models-dir` of never-loaded GGUF files: a storm of concurrent first requests to several of them (each derives
its config and tokenizer from the file in a worker thread, the first import of transformers among them) all answer
200, under --max-loaded-models 1."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from tests.e2e.test_models_dir import start
from tests.engine.gguf.files import write_llama

MODELS, REQUESTS = 3, 12


def test_concurrent_first_requests_to_several_gguf_files_all_succeed(tmp_path: Path) -> None:
    root = tmp_path / "dir"
    root.mkdir()
    for i in range(MODELS):
        write_llama(root / f"tiny-{i}.gguf", seed=i)  # fresh files: their folders are derived on this first load
    server = start(root, tmp_path, "--max-loaded-models", "1")
    try:

        def complete(i: int) -> tuple[int, str]:
            body = {"model": f"tiny-{i % MODELS}", "prompt": "ab", "max_tokens": 2}
            r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=300)
            return r.status_code, r.text[:300]

        with ThreadPoolExecutor(REQUESTS) as pool:
            answers = list(pool.map(complete, range(REQUESTS)))
    finally:
        server.stop()
    assert [code for code, _ in answers] == [200] * REQUESTS, answers
