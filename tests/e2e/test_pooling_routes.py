"""vLLM's pooling routes on real servers, with httpx: /classify against transformers'
AutoModelForSequenceClassification,
/score and /rerank (+ /v1) against sentence-transformers' CrossEncoder (a one-label classifier) and against
SentenceTransformer's cosine (an embedding model), /pooling's raw output (ALL: one row per token); the
documents-per-request limit at, under and over it; the refusals (400s naming the field)."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from tests.e2e.conftest import Server, start_server

QUERY = "what does a cat eat"
DOCS = [
    "cats eat fish and meat",
    "the stock market fell today",
    "a kitten drinks milk",
    "paris is the capital of france",
]


@pytest.fixture(scope="module")
def cls_server(qwen2_cls_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(
        qwen2_cls_ckpt,
        tmp_path_factory.mktemp("cls"),
        "--runner",
        "pooling",
        "--max-model-len",
        "64",
        "--max-num-batched-tokens",
        "16",
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def ce_server(qwen2_ce_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(
        qwen2_ce_ckpt,
        tmp_path_factory.mktemp("ce"),
        "--runner",
        "pooling",
        "--max-documents-per-request",
        "4",
        "--max-model-len",
        "128",
        "--max-num-queued-tokens",
        "200",
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def bi_server(st_mean_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(st_mean_ckpt, tmp_path_factory.mktemp("bi"), "--runner", "pooling")
    yield s
    s.stop()


def post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def ids_of(ckpt: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    tokens: list[int] = AutoTokenizer.from_pretrained(ckpt)(text)["input_ids"]
    return tokens


def test_classify_matches_transformers(cls_server: Server, qwen2_cls_ckpt: Path) -> None:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(qwen2_cls_ckpt, dtype=torch.float32).eval()
    texts = ["a short one", "a longer input that takes more than one sixteen-token step to go through the model"]
    ids = [ids_of(qwen2_cls_ckpt, t) for t in texts]
    r = post(cls_server, "/classify", {"input": texts})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["id"].startswith("classify-") and body["model"] == "tiny"
    assert body["usage"] == {
        "prompt_tokens": sum(map(len, ids)),
        "total_tokens": sum(map(len, ids)),
        "completion_tokens": 0,
    }
    for d, i in zip(body["data"], ids):
        with torch.no_grad():
            probs = torch.softmax(model(torch.tensor([i])).logits[0], dim=-1).numpy()
        np.testing.assert_allclose(d["probs"], probs, atol=1e-4)
        assert d["num_classes"] == 3 and d["label"] == model.config.id2label[int(probs.argmax())]
    by_ids = post(cls_server, "/classify", {"input": ids, "use_activation": False}).json()  # raw logits
    with torch.no_grad():
        logits = model(torch.tensor([ids[0]])).logits[0].numpy()
    np.testing.assert_allclose(by_ids["data"][0]["probs"], logits, atol=1e-4)


def test_pooling_route_classifier_and_all_rows(cls_server: Server, qwen2_ckpt: Path, tmp_path: Path) -> None:
    one = post(cls_server, "/pooling", {"input": [5, 6, 7]}).json()
    probs = post(cls_server, "/classify", {"input": [5, 6, 7]}).json()["data"][0]["probs"]
    assert one["id"].startswith("pool-") and one["data"][0]["object"] == "pooling"
    np.testing.assert_allclose(one["data"][0]["data"], probs, atol=1e-6)
    s = start_server(qwen2_ckpt, tmp_path, "--runner", "pooling", "--pooler-config", '{"pooling_type": "ALL"}')
    try:
        from transformers import AutoModel

        ids = [3, 1000, 20, 7, 9]
        with torch.no_grad():
            hidden = AutoModel.from_pretrained(qwen2_ckpt).eval()(torch.tensor([ids])).last_hidden_state[0]
        rows = torch.nn.functional.normalize(hidden, dim=-1).numpy()
        body = post(s, "/pooling", {"input": ids}).json()
        np.testing.assert_allclose(body["data"][0]["data"], rows, atol=1e-4)  # one normalized row per token
        raw = post(s, "/pooling", {"input": ids, "normalize": False, "encoding_format": "base64"}).json()
        got = np.frombuffer(base64.b64decode(raw["data"][0]["data"]), dtype="<f4").reshape(len(ids), -1)
        np.testing.assert_allclose(got, hidden.numpy(), atol=1e-4)
        r = post(s, "/v1/embeddings", {"input": "hi"})  # one vector per input is impossible with ALL
        assert r.status_code == 400 and "/pooling" in r.json()["error"]["message"]
    finally:
        s.stop()


def cross_encoder_scores(ckpt: Path, pairs: list[tuple[str, str]]) -> np.ndarray:
    from sentence_transformers import CrossEncoder

    scores: np.ndarray = CrossEncoder(str(ckpt), device="cpu").predict(pairs, batch_size=1)
    return scores


def test_score_cross_encoder_one_to_many_and_zipped(ce_server: Server, qwen2_ce_ckpt: Path) -> None:
    expected = cross_encoder_scores(qwen2_ce_ckpt, [(QUERY, d) for d in DOCS])
    for path in ("/score", "/v1/score"):
        body = post(ce_server, path, {"queries": QUERY, "documents": DOCS}).json()
        assert [d["index"] for d in body["data"]] == [0, 1, 2, 3] and body["data"][0]["object"] == "score"
        np.testing.assert_allclose([d["score"] for d in body["data"]], expected, atol=1e-4)
    zipped = post(ce_server, "/score", {"text_1": [QUERY, "capital city"], "text_2": DOCS[:2]}).json()
    np.testing.assert_allclose(
        [d["score"] for d in zipped["data"]],
        cross_encoder_scores(qwen2_ce_ckpt, [(QUERY, DOCS[0]), ("capital city", DOCS[1])]),
        atol=1e-4,
    )
    pairs = [ids_of(qwen2_ce_ckpt, QUERY + d) for d in DOCS]  # a Qwen2 pair is the two texts one after the other
    assert body["usage"]["prompt_tokens"] == sum(map(len, pairs))


def test_rerank_cross_encoder_order_top_n_and_shapes(ce_server: Server, qwen2_ce_ckpt: Path) -> None:
    expected = cross_encoder_scores(qwen2_ce_ckpt, [(QUERY, d) for d in DOCS])
    order = [int(i) for i in np.argsort(-expected, kind="stable")]
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        body = post(ce_server, path, {"query": QUERY, "documents": DOCS}).json()
        assert body["id"].startswith("rerank-") and body["model"] == "tiny"
        assert [r["index"] for r in body["results"]] == order
        np.testing.assert_allclose([r["relevance_score"] for r in body["results"]], expected[order], atol=1e-4)
        assert [r["document"]["text"] for r in body["results"]] == [DOCS[i] for i in order]
        assert ("meta" in body) == (path == "/v2/rerank")
    top = post(
        ce_server,
        "/rerank",
        {"query": QUERY, "documents": [{"text": d} for d in DOCS], "top_n": 2, "return_documents": False},
    ).json()
    assert [r["index"] for r in top["results"]] == order[:2] and "document" not in top["results"][0]


@pytest.mark.parametrize("count, status", [(3, 200), (4, 200), (5, 400)])
def test_documents_per_request_limit(ce_server: Server, count: int, status: int) -> None:
    docs = [f"document number {i}" for i in range(count)]
    for path, body in (
        ("/rerank", {"query": QUERY, "documents": docs}),
        ("/score", {"queries": QUERY, "documents": docs}),
    ):
        r = post(ce_server, path, body)
        assert r.status_code == status, r.text
        if status == 400:
            assert "--max-documents-per-request" in r.json()["error"]["message"]
            assert r.json()["error"]["param"] == "documents"
        else:
            assert len(r.json()["results" if path == "/rerank" else "data"]) == count


def test_bi_encoder_score_and_rerank_are_cosines(bi_server: Server, st_mean_ckpt: Path) -> None:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(st_mean_ckpt), device="cpu")
    cos = st.similarity(st.encode([QUERY]), st.encode(DOCS))[0].numpy()
    body = post(bi_server, "/score", {"data_1": QUERY, "data_2": DOCS}).json()
    np.testing.assert_allclose([d["score"] for d in body["data"]], cos, atol=1e-5)
    ranked = post(bi_server, "/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 3}).json()
    order = [int(i) for i in np.argsort(-cos, kind="stable")][:3]
    assert [r["index"] for r in ranked["results"]] == order
    np.testing.assert_allclose([r["relevance_score"] for r in ranked["results"]], cos[order], atol=1e-5)
    assert ranked["usage"]["total_tokens"] == len(st.tokenizer(QUERY)["input_ids"]) + sum(
        len(st.tokenizer(d)["input_ids"]) for d in DOCS
    )  # the query embedded once
    r = post(bi_server, "/rerank", {"query": QUERY, "documents": ["a", ""]})  # nothing to embed
    assert r.status_code == 400 and "empty after tokenization" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "path, body, param, words",
    [
        ("/rerank", {"documents": ["a"]}, "query", "query is required"),
        ("/rerank", {"query": "q", "documents": []}, "documents", "non-empty"),
        ("/rerank", {"query": "q"}, "documents", "non-empty"),
        ("/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, "top_n", "at least 0"),
        ("/v2/rerank", {"query": "q", "documents": ["a"], "max_tokens_per_doc": 0}, "max_tokens_per_doc", "at least 1"),
        ("/score", {"queries": ["a", "b"], "documents": ["x", "y", "z"]}, "documents", "1:1, 1:N or N:N"),
        ("/score", {"queries": "a"}, "documents", "documents is required"),
        ("/score", {"documents": ["a"], "text_1": "b"}, "queries", "one pair"),
        ("/score", {"queries": "q", "documents": [" ".join(["long"] * 200)]}, "documents", "maximum context length"),
        (
            "/score",
            {"queries": "q", "documents": ["x"], "truncate_prompt_tokens": 129},
            "truncate_prompt_tokens",
            "between 1 and",
        ),
        ("/score", {"queries": "q", "documents": ["x"], "priority": 3}, "priority", "priority scheduling"),
        ("/v1/embeddings", {"input": "hi"}, None, "embedding model"),
        ("/pooling", {"input": [10**7]}, "input", "out of vocabulary"),
    ],
)
def test_refusals(ce_server: Server, path: str, body: dict[str, Any], param: str | None, words: str) -> None:
    r = post(ce_server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["param"] == param, err
    assert post(ce_server, "/rerank", {"query": "q", "documents": ["a"]}).status_code == 200  # unaffected


def test_truncated_pair_keeps_the_query(ce_server: Server, qwen2_ce_ckpt: Path) -> None:
    long_doc = " ".join(["long"] * 200)
    body = post(ce_server, "/score", {"queries": QUERY, "documents": [long_doc], "truncate_prompt_tokens": 40}).json()
    ids = ids_of(qwen2_ce_ckpt, QUERY + long_doc)[:40]
    assert body["usage"]["prompt_tokens"] == 40
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(qwen2_ce_ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = torch.sigmoid(model(torch.tensor([ids])).logits[0, 0]).item()
    assert body["data"][0]["score"] == pytest.approx(expected, abs=1e-4)


def test_max_tokens_per_doc_cuts_each_document(ce_server: Server, qwen2_ce_ckpt: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen2_ce_ckpt)
    cut = [tok.decode(tok(d, add_special_tokens=False)["input_ids"][:3]) for d in DOCS]
    expected = cross_encoder_scores(qwen2_ce_ckpt, [(QUERY, d) for d in cut])
    body = post(ce_server, "/v2/rerank", {"query": QUERY, "documents": DOCS, "max_tokens_per_doc": 3}).json()
    by_index = {r["index"]: r["relevance_score"] for r in body["results"]}
    np.testing.assert_allclose([by_index[i] for i in range(len(DOCS))], expected, atol=1e-4)
    assert body["usage"]["prompt_tokens"] == sum(len(ids_of(qwen2_ce_ckpt, QUERY + d)) for d in cut)


def test_a_classifier_with_several_labels_cannot_score(cls_server: Server) -> None:
    r = post(cls_server, "/rerank", {"query": "q", "documents": ["a"]})
    assert r.status_code == 400 and "3 labels" in r.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/classify", "/score", "/rerank", "/v2/rerank", "/pooling", "/v2/embed"])
def test_pooling_routes_refused_on_a_generation_server(server: Server, path: str) -> None:
    r = post(server, path, {"input": "hi", "query": "q", "documents": ["a"], "texts": ["a"]})
    assert r.status_code == 400 and "--runner pooling" in r.json()["error"]["message"], r.text


def test_cohere_sdk_rerank_equals_the_cross_encoder(ce_server: Server, qwen2_ce_ckpt: Path) -> None:
    import cohere
    from sentence_transformers import CrossEncoder

    ranked = CrossEncoder(str(qwen2_ce_ckpt), device="cpu").rank(QUERY, DOCS, top_k=3)
    res = cohere.ClientV2(api_key="none", base_url=ce_server.url, timeout=60).rerank(
        model="tiny", query=QUERY, documents=DOCS, top_n=3
    )
    assert [r.index for r in res.results] == [r["corpus_id"] for r in ranked]
    np.testing.assert_allclose([r.relevance_score for r in res.results], [r["score"] for r in ranked], atol=1e-4)
    assert res.meta is not None and res.meta.api_version is not None and res.meta.api_version.version == "2"
    with pytest.raises(cohere.BadRequestError, match="--max-documents-per-request"):
        cohere.ClientV2(api_key="none", base_url=ce_server.url).rerank(model="tiny", query=QUERY, documents=DOCS * 2)


def test_admission_and_metrics(ce_server: Server) -> None:
    """The queued-token limit (200) holds for a rerank's documents together: one batch admitted or refused."""
    before = ce_server.metric("spindle_request_success_total", 'finished_reason="stop"')
    long_docs = [" ".join(f"w{i}" for i in range(25)) for _ in range(4)]  # about 4 x 60 tokens in all
    r = post(ce_server, "/rerank", {"query": QUERY, "documents": long_docs})
    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
    ok = post(ce_server, "/rerank", {"query": QUERY, "documents": long_docs[:2]})
    assert ok.status_code == 200, ok.text
    assert ce_server.metric("spindle_request_success_total", 'finished_reason="stop"') == before + 2  # per document
