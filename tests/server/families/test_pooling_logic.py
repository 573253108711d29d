"""The pooling routes' arithmetic against its references: Cohere's embedding types against sentence-transformers'
`quantize_embeddings` (with the fixed ranges the server documents), scores and pairing, activations against
torch, and `input_type` -> prompt."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.messages import PoolingInfo
from server.families.cohere.input_types import COHERE_INPUT_TYPES, prompt_for
from server.families.cohere.quantize import quantize, ranges
from server.families.pooling.finishing import activate, l2_normalize
from server.families.pooling.scoring import cosine, pair_up, rerank_order
from server.http.errors import APIError


def embeddings(n: int, d: int, seed: int = 0, scale: float = 1.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    e = rng.standard_normal((n, d)).astype(np.float32)
    return (l2_normalize(e) * scale).astype(np.float32)


@pytest.mark.parametrize("n, d", [(1, 64), (5, 64), (3, 20)])
@pytest.mark.parametrize("kind", ["int8", "uint8", "binary", "ubinary"])
def test_types_equal_quantize_embeddings(kind: str, n: int, d: int) -> None:
    from sentence_transformers.util.quantization import quantize_embeddings

    e = embeddings(n, d, seed=n + d)
    e[0, :3] = [1.0, -1.0, 0.0]  # the ends of the range and the binary threshold
    expected = quantize_embeddings(e, precision=kind, ranges=ranges(d))  # type: ignore[arg-type]
    got = np.array(quantize(e, kind))
    assert got.dtype.kind == "i" and got.shape == expected.shape
    np.testing.assert_array_equal(got, expected.astype(np.int64))


def test_binary_is_ubinary_minus_128_packed_msb_first() -> None:
    e = np.array([[0.5, -0.1, 0.0, 0.2, -1, 1, 1, -1, 0.3]], dtype=np.float32)  # 9 dims: two bytes
    assert quantize(e, "ubinary") == [[0b10010110, 0b10000000]]
    assert quantize(e, "binary") == [[0b10010110 - 128, 0b10000000 - 128]]


def test_int8_saturates_outside_the_range_and_base64_is_float32() -> None:
    e = np.array([[3.0, -3.0, 0.0]], dtype=np.float32)
    assert quantize(e, "int8") == [[127, -128, -1]] and quantize(e, "uint8") == [[255, 0, 127]]  # 0: bucket 127
    import base64

    (b,) = quantize(e, "base64")
    np.testing.assert_array_equal(np.frombuffer(base64.b64decode(b), dtype="<f4"), e[0])
    assert quantize(e, "float") == [[3.0, -3.0, 0.0]]


def test_pair_up() -> None:
    names = ("queries", "documents")
    assert pair_up(["q"], ["a", "b"], names) == [("q", "a"), ("q", "b")]
    assert pair_up(["q", "r"], ["a", "b"], names) == [("q", "a"), ("r", "b")]
    for qs, ds, param in ((["q", "r"], ["a", "b", "c"], "documents"), ([], ["a"], "queries"), (["q"], [], "documents")):
        with pytest.raises(APIError) as e:
            pair_up(qs, ds, names)
        assert e.value.param == param


def test_cosine_and_order() -> None:
    from sentence_transformers.util import cos_sim

    a, b = embeddings(2, 16, scale=3.0)
    assert cosine(a, b) == pytest.approx(float(cos_sim(torch.tensor(a), torch.tensor(b))[0, 0]), abs=1e-6)
    assert rerank_order([0.1, 0.9, 0.5, 0.9], None) == [1, 3, 2, 0]  # ties: the earlier first
    assert rerank_order([0.1, 0.9, 0.5, 0.9], 2) == [1, 3] and rerank_order([0.2], 0) == [0]


@pytest.mark.parametrize(
    "name, ref",
    [
        ("softmax", lambda t: torch.softmax(t, -1)),
        ("sigmoid", torch.sigmoid),
        ("tanh", torch.tanh),
        ("identity", lambda t: t),
    ],
)
def test_activations(name: str, ref: object) -> None:
    x = np.random.default_rng(1).standard_normal((4, 3)).astype(np.float32) * 5
    np.testing.assert_allclose(activate(x, name), ref(torch.tensor(x)).numpy(), atol=1e-6)  # type: ignore[operator]


def info(prompts: dict[str, str], default: str | None = None) -> PoolingInfo:
    return PoolingInfo(task="embed", pooling_type="MEAN", hidden_size=8, prompts=prompts, default_prompt_name=default)


def test_input_types_map_to_prompts() -> None:
    with_prompts = info({"query": "query: ", "document": "passage: ", "clustering": "cluster: "}, "query")
    assert prompt_for("search_query", with_prompts) == "query: "
    assert prompt_for("search_document", with_prompts) == "passage: "
    assert prompt_for("clustering", with_prompts) == "cluster: " and prompt_for("query", with_prompts) == "query: "
    assert prompt_for(None, with_prompts) == "query: "  # default_prompt_name
    with pytest.raises(APIError) as e:
        prompt_for("classification", with_prompts)
    assert e.value.param == "input_type"
    assert "clustering, document, query, search_document, search_query" in e.value.message
    plain = info({})
    assert all(prompt_for(t, plain) == "" for t in COHERE_INPUT_TYPES) and prompt_for(None, plain) == ""
    with pytest.raises(APIError, match="search_document, search_query, classification, clustering, image"):
        prompt_for("poetry", plain)
