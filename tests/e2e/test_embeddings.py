"""POST /v1/embeddings on a `--runner pooling` server: the official openai SDK's embeddings.create, unmodified
(floats and base64), against transformers' last hidden state pooled the same way; the refusals (400s)."""

from __future__ import annotations

import base64
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F

from tests.e2e.conftest import Server, start_server
from tests.helpers.processes import wait_until

_HF: dict[Path, object] = {}


def hf_embedding(ckpt: Path, ids: list[int], pooling: str = "LAST", dims: int | None = None) -> np.ndarray:
    from transformers import AutoModel

    if ckpt not in _HF:
        _HF[ckpt] = AutoModel.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = _HF[ckpt](torch.tensor([ids])).last_hidden_state[0]  # type: ignore[operator]
    v = hidden[-1] if pooling == "LAST" else hidden.mean(dim=0)
    if dims is not None:
        v = v[:dims]
    return F.normalize(v, dim=-1).numpy()


@pytest.fixture(scope="module")
def pooling_server(qwen2_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # 32 tokens a step: the long inputs below take several chunked-prefill steps
    tmp = tmp_path_factory.mktemp("emb")
    s = start_server(
        qwen2_ckpt,
        tmp,
        "--batch-dir",
        str(tmp / "batches"),
        "--runner",
        "pooling",
        "--max-num-batched-tokens",
        "32",
        "--max-model-len",
        "128",
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def matryoshka_ckpt(qwen2_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same weights with config.json declaring Matryoshka dimensions."""
    folder = tmp_path_factory.mktemp("matryoshka") / "ckpt"
    shutil.copytree(qwen2_ckpt, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "matryoshka_dimensions": [16, 32]}))
    return folder


def ids_of(server: Server, text: str) -> list[int]:
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": text}, timeout=30)
    tokens: list[int] = r.json()["tokens"]
    return tokens


def test_sdk_floats_single_batched_and_long(pooling_server: Server, qwen2_ckpt: Path) -> None:
    client = openai.OpenAI(base_url=f"{pooling_server.url}/v1", api_key="none")
    texts = [
        "hello",
        "a somewhat longer sentence, to batch inputs of different lengths 你好",
        " ".join(["long"] * 100),
    ]  # > 32 tokens: chunked prefill
    res = client.embeddings.create(model="tiny", input=texts)
    assert res.object == "list" and res.model == "tiny" and [d.index for d in res.data] == [0, 1, 2]
    ids = [ids_of(pooling_server, t) for t in texts]
    assert len(ids[2]) > 32
    assert res.usage.prompt_tokens == res.usage.total_tokens == sum(map(len, ids))
    for d, i in zip(res.data, ids):
        assert d.object == "embedding" and len(d.embedding) == 64
        np.testing.assert_allclose(d.embedding, hf_embedding(qwen2_ckpt, i), atol=1e-4)
    one = client.embeddings.create(model="tiny", input=texts[1])
    np.testing.assert_allclose(one.data[0].embedding, res.data[1].embedding, atol=1e-5)
    by_ids = client.embeddings.create(model="tiny", input=ids)  # a list of token-id lists
    for a, b in zip(by_ids.data, res.data):
        np.testing.assert_allclose(a.embedding, b.embedding, atol=1e-5)
    flat = client.embeddings.create(model="tiny", input=ids[0])  # one list of token ids
    np.testing.assert_allclose(flat.data[0].embedding, res.data[0].embedding, atol=1e-5)


def test_sdk_base64(pooling_server: Server) -> None:
    """The SDK asks for base64 when no encoding_format is given and decodes it; given, it hands the text back."""
    client = openai.OpenAI(base_url=f"{pooling_server.url}/v1", api_key="none")
    floats = client.embeddings.create(model="tiny", input=["x y z", "w"], encoding_format="float")
    default = client.embeddings.create(model="tiny", input=["x y z", "w"])  # base64 on the wire, decoded
    raw = client.embeddings.create(model="tiny", input=["x y z", "w"], encoding_format="base64")
    for a, b, c in zip(floats.data, default.data, raw.data):
        assert isinstance(a.embedding, list) and isinstance(c.embedding, str)
        np.testing.assert_allclose(b.embedding, a.embedding, atol=1e-6)
        # base64 of little-endian float32, as OpenAI
        np.testing.assert_allclose(np.frombuffer(base64.b64decode(c.embedding), dtype="<f4"), a.embedding, atol=1e-6)


@pytest.mark.parametrize(
    "body, words",
    [
        ({"input": "hi", "dimensions": 8}, "Matryoshka"),
        ({"input": [151_700]}, "out of vocabulary"),  # tiktoken ids as LangChain sends them
        ({"input": [[1, 2], [10**6]]}, "out of vocabulary"),
        ({"input": list(range(1, 130))}, "maximum context length is 128"),
        ({"input": " ".join(["long"] * 200)}, "maximum context length is 128"),
        ({"input": []}, "empty"),
        ({"input": [1, "a"]}, "do not mix"),
        ({"input": ""}, "empty"),
        ({"input": "hi", "encoding_format": "hex"}, "encoding_format"),
    ],
)
def test_refusals(pooling_server: Server, body: dict[str, object], words: str) -> None:
    r = httpx.post(f"{pooling_server.url}/v1/embeddings", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"]


def test_a_full_context_input_is_served(pooling_server: Server, qwen2_ckpt: Path) -> None:
    ids = [(7 * i) % 1000 + 1 for i in range(128)]  # exactly max_model_len: no room for output is needed
    r = httpx.post(f"{pooling_server.url}/v1/embeddings", json={"input": ids}, timeout=60)
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(r.json()["data"][0]["embedding"], hf_embedding(qwen2_ckpt, ids), atol=1e-4)


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/messages", {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}),
        ("/inference/v1/generate", {"token_ids": [1, 2], "sampling_params": {"max_tokens": 2}}),
    ],
)
def test_generation_routes_refused_on_a_pooling_server(
    pooling_server: Server, path: str, body: dict[str, object]
) -> None:
    r = httpx.post(f"{pooling_server.url}{path}", json=body, timeout=30)
    assert r.status_code == 400 and "--runner" in r.text, r.text


def test_matryoshka_and_mean_pooling(matryoshka_ckpt: Path, tmp_path: Path) -> None:
    s = start_server(
        matryoshka_ckpt,
        tmp_path,
        "--runner",
        "pooling",
        "--pooler-config",
        '{"pooling_type": "MEAN", "normalize": true}',
        "--max-num-batched-tokens",
        "16",
    )
    try:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="none")
        ids = [[(5 * i) % 900 + 3 for i in range(50)], [9, 8, 7]]  # 50 tokens: MEAN summed over 4 chunks
        for dims in (None, 16, 32):
            res = (
                client.embeddings.create(model="tiny", input=ids, dimensions=dims)
                if dims
                else client.embeddings.create(model="tiny", input=ids)
            )
            for d, i in zip(res.data, ids):
                assert len(d.embedding) == (dims or 64)
                np.testing.assert_allclose(d.embedding, hf_embedding(matryoshka_ckpt, i, "MEAN", dims), atol=1e-4)
        r = httpx.post(f"{s.url}/v1/embeddings", json={"input": "hi", "dimensions": 8})
        assert r.status_code == 400 and "[16, 32]" in r.json()["error"]["message"]
    finally:
        s.stop()


def test_embeddings_refused_on_a_generation_server(server: Server) -> None:
    r = httpx.post(f"{server.url}/v1/embeddings", json={"input": "hi"}, timeout=30)
    assert r.status_code == 400 and "--runner pooling" in r.json()["error"]["message"]


def hf_raw(ckpt: Path, ids: list[int]) -> np.ndarray:
    from transformers import AutoModel

    if ckpt not in _HF:
        _HF[ckpt] = AutoModel.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        out: np.ndarray = _HF[ckpt](torch.tensor([ids])).last_hidden_state[0, -1].numpy()  # type: ignore[operator]
    return out


def test_normalize_and_truncate_prompt_tokens(pooling_server: Server, qwen2_ckpt: Path) -> None:
    """vLLM's extras: `normalize` false gives the raw vector; truncate_prompt_tokens keeps the last k tokens."""
    ids = [(11 * i) % 2000 + 5 for i in range(150)]  # longer than the context (128)
    url = f"{pooling_server.url}/v1/embeddings"
    raw = httpx.post(url, json={"input": ids[:20], "normalize": False}, timeout=60).json()["data"][0]["embedding"]
    np.testing.assert_allclose(raw, hf_raw(qwen2_ckpt, ids[:20]), atol=1e-4)
    for k, kept in ((-1, ids[-128:]), (128, ids[-128:]), (127, ids[-127:]), (7, ids[-7:])):
        r = httpx.post(url, json={"input": ids, "truncate_prompt_tokens": k}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(kept)
        np.testing.assert_allclose(r.json()["data"][0]["embedding"], hf_embedding(qwen2_ckpt, kept), atol=1e-4)
    for k in (129, 0, -2):
        r = httpx.post(url, json={"input": ids, "truncate_prompt_tokens": k}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text
    text = " ".join(["long"] * 200)  # a text too long for the context is cut, not refused
    r = httpx.post(url, json={"input": text, "truncate_prompt_tokens": 16}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 16


def test_embeddings_refused_on_a_classifier(qwen2_cls_ckpt: Path, tmp_path: Path) -> None:
    s = start_server(qwen2_cls_ckpt, tmp_path, "--runner", "pooling")
    try:
        r = httpx.post(f"{s.url}/v1/embeddings", json={"input": "hi"}, timeout=30)
        assert r.status_code == 400 and "embedding model" in r.json()["error"]["message"]
        ok = httpx.post(f"{s.url}/classify", json={"input": "hi"}, timeout=30)  # unaffected
        assert ok.status_code == 200 and len(ok.json()["data"][0]["probs"]) == 3
    finally:
        s.stop()


def test_an_embeddings_batch_equals_the_online_answers(pooling_server: Server) -> None:
    client = openai.OpenAI(base_url=f"{pooling_server.url}/v1", api_key="none", max_retries=0)
    bodies = [{"model": "tiny", "input": text} for text in ("hello", "a batch of embeddings", "third")]
    lines = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings", "body": b} for i, b in enumerate(bodies)]
    upload = client.files.create(file=("e.jsonl", "\n".join(map(json.dumps, lines)).encode()), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/embeddings", completion_window="24h")
    wait_until(lambda: client.batches.retrieve(batch.id).status == "completed", 120, "the embeddings batch completed")
    done = client.batches.retrieve(batch.id)
    assert done.output_file_id is not None and done.request_counts.completed == 3
    for raw in client.files.content(done.output_file_id).text.splitlines():
        item = json.loads(raw)
        online = httpx.post(
            f"{pooling_server.url}/v1/embeddings", json=bodies[int(item["custom_id"][1:])], timeout=60
        ).json()
        answer = item["response"]["body"]
        assert item["response"]["status_code"] == 200 and len(answer["data"]) == 1
        np.testing.assert_allclose(answer["data"][0]["embedding"], online["data"][0]["embedding"], rtol=0, atol=1e-6)
