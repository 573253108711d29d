"""Cohere's v2 API through the official `cohere` SDK (ClientV2.embed, ClientV2.rerank), unmodified, against the real
server: embeddings equal to sentence-transformers' (prompts by input type, MEAN pooling, Normalize), every embedding
type equal to `quantize_embeddings` with the server's documented ranges, Matryoshka `output_dimension`, `truncate`,
rerank order and scores, the API key, and the refusals; images on a vision model against transformers."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cohere
import httpx
import numpy as np
import pytest
import torch

from tests.e2e.conftest import Server, start_server

KEY = "sk-cohere-test"
TEXTS = ["hello world", "cats eat fish and meat", "a kitten drinks milk, a cat hunts mice in the barn"]


@pytest.fixture(scope="module")
def st_matryoshka(st_mean_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.pooling_checkpoints import with_config

    return with_config(st_mean_ckpt, tmp_path_factory.mktemp("mat") / "ckpt", matryoshka_dimensions=[16, 32])


@pytest.fixture(scope="module")
def embed_server(st_matryoshka: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(
        st_matryoshka,
        tmp_path_factory.mktemp("co"),
        "--runner",
        "pooling",
        "--api-key",
        KEY,
        "--max-model-len",
        "64",
        "--max-prompts-per-request",
        "3",
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def st_model(st_mean_ckpt: Path) -> Any:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(st_mean_ckpt), device="cpu")


def client(server: Server, key: str = KEY) -> cohere.ClientV2:
    return cohere.ClientV2(api_key=key, base_url=server.url, timeout=60)


@pytest.mark.parametrize("input_type, prompt", [("search_query", "query"), ("search_document", "document")])
def test_embed_floats_equal_sentence_transformers(
    embed_server: Server, st_model: Any, input_type: str, prompt: str
) -> None:
    res = client(embed_server).embed(model="tiny", texts=TEXTS, input_type=input_type, embedding_types=["float"])
    expected = st_model.encode(TEXTS, prompt_name=prompt)
    assert res.embeddings.float_ is not None and len(res.embeddings.float_) == 3
    np.testing.assert_allclose(np.array(res.embeddings.float_), expected, atol=1e-5)
    assert res.texts == TEXTS and res.id and res.meta is not None and res.meta.api_version is not None
    assert res.meta.api_version.version == "2" and res.meta.billed_units is not None
    with_prompt = [st_model.tokenizer(st_model.prompts[prompt] + t)["input_ids"] for t in TEXTS]
    assert res.meta.billed_units.input_tokens == sum(map(len, with_prompt))


def test_every_embedding_type(embed_server: Server) -> None:
    from sentence_transformers.util.quantization import quantize_embeddings

    from server.families.cohere.quantize import ranges

    types = ["float", "int8", "uint8", "binary", "ubinary", "base64"]
    res = client(embed_server).embed(model="tiny", texts=TEXTS[:2], input_type="search_document", embedding_types=types)
    e = res.embeddings
    floats = np.array(e.float_, dtype=np.float32)
    for kind, got in (("int8", e.int8), ("uint8", e.uint8), ("binary", e.binary), ("ubinary", e.ubinary)):
        np.testing.assert_array_equal(np.array(got), quantize_embeddings(floats, kind, ranges=ranges(64)))  # type: ignore[arg-type]
    assert len(e.binary[0]) == 64 // 8 and all(-128 <= v <= 127 for v in e.binary[0])  # type: ignore[index]
    assert e.base64 is not None
    np.testing.assert_array_equal(np.stack([np.frombuffer(base64.b64decode(b), dtype="<f4") for b in e.base64]), floats)
    one = client(embed_server).embed(
        model="tiny", texts=TEXTS[:1], input_type="search_document", embedding_types=["int8"]
    )  # one text: the same ranges, the same values
    assert one.embeddings.int8 == e.int8[:1]  # type: ignore[index]


def test_output_dimension_is_a_matryoshka_cut(embed_server: Server, st_model: Any) -> None:
    full = st_model.encode(TEXTS, prompt_name="query")
    for dims in (16, 32):
        res = client(embed_server).embed(
            model="tiny", texts=TEXTS, input_type="search_query", embedding_types=["float"], output_dimension=dims
        )
        cut = full[:, :dims] / np.linalg.norm(full[:, :dims], axis=1, keepdims=True)
        np.testing.assert_allclose(np.array(res.embeddings.float_), cut, atol=1e-5)
    with pytest.raises(cohere.BadRequestError, match=r"\[16, 32\]"):
        client(embed_server).embed(model="tiny", texts=TEXTS, input_type="search_query", output_dimension=8)


def test_truncate_modes(embed_server: Server, st_model: Any) -> None:
    text = " ".join(f"word{i}" for i in range(40))
    co = client(embed_server)
    ids = st_model.tokenizer("query: " + text)["input_ids"]
    assert len(ids) > 8
    end = co.embed(model="tiny", texts=[text], input_type="search_query", max_tokens=8, truncate="END")
    start = co.embed(model="tiny", texts=[text], input_type="search_query", max_tokens=8, truncate="START")
    for res, kept in ((end, ids[:8]), (start, ids[-8:])):
        ref = httpx.post(
            f"{embed_server.url}/v1/embeddings",
            json={"input": kept},
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=30,
        ).json()["data"][0]["embedding"]
        np.testing.assert_allclose(res.embeddings.float_[0], ref, atol=1e-6)  # type: ignore[index]
        assert res.meta.billed_units.input_tokens == 8  # type: ignore[union-attr]
    st_model.max_seq_length = 8  # sentence-transformers cuts the end
    try:
        np.testing.assert_allclose(
            end.embeddings.float_[0],
            st_model.encode([text], prompt_name="query")[0],  # type: ignore[index]
            atol=1e-5,
        )
    finally:
        st_model.max_seq_length = 1024
    with pytest.raises(cohere.BadRequestError, match="max_tokens is 8 tokens"):
        co.embed(model="tiny", texts=[text], input_type="search_query", max_tokens=8, truncate="NONE")
    long_text = " ".join(["long"] * 100)  # past the context (64) and no max_tokens: END still cuts it
    assert len(co.embed(model="tiny", texts=[long_text], input_type="search_query").embeddings.float_[0]) == 64  # type: ignore[index]


@pytest.mark.parametrize(
    "kw, param, words",
    [
        (
            dict(texts=TEXTS, input_type="classification"),
            "input_type",
            "document, query, search_document, search_query",
        ),
        (dict(texts=TEXTS, input_type="search_query", embedding_types=["float16"]), "embedding_types", "float16"),
        (dict(texts=TEXTS, input_type="search_query", truncate="MIDDLE"), "truncate", "NONE, START or END"),
        (dict(texts=[], input_type="search_query"), "texts", "must not be empty"),
        (dict(texts=TEXTS + ["one more"], input_type="search_query"), "texts", "--max-prompts-per-request"),
        (dict(texts=["a"], images=["data:image/png;base64,AAAA"], input_type="image"), "texts", "one of texts"),
        (dict(images=["data:image/png;base64,AAAA"], input_type="search_document"), "images", "takes no images"),
        (dict(texts=[""], input_type="clustering"), "input_type", "not supported"),
    ],
)
def test_refusals(embed_server: Server, kw: dict[str, Any], param: str, words: str) -> None:
    r = httpx.post(
        f"{embed_server.url}/v2/embed",
        json={"model": "tiny", **kw},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["param"] == param, err
    with pytest.raises(cohere.BadRequestError):
        client(embed_server).embed(model="tiny", **kw)


def test_limit_at_and_under_and_the_api_key(embed_server: Server) -> None:
    for n in (2, 3):  # --max-prompts-per-request 3: at and under
        res = client(embed_server).embed(model="tiny", texts=TEXTS[:n], input_type="search_query")
        assert len(res.embeddings.float_ or []) == n
    with pytest.raises(cohere.UnauthorizedError):
        client(embed_server, "wrong").embed(model="tiny", texts=TEXTS, input_type="search_query")


def test_rerank_bi_encoder(embed_server: Server, st_model: Any) -> None:
    docs = TEXTS + ["paris is the capital of france"]
    res = client(embed_server).rerank(model="tiny", query="what do cats eat", documents=docs, top_n=3)
    cos = st_model.similarity(st_model.encode(["what do cats eat"]), st_model.encode(docs))[0].numpy()
    order = [int(i) for i in np.argsort(-cos, kind="stable")][:3]
    assert [r.index for r in res.results] == order
    np.testing.assert_allclose([r.relevance_score for r in res.results], cos[order], atol=1e-5)
    assert res.meta is not None and res.meta.billed_units is not None and res.meta.billed_units.search_units == 1


def png(seed: int, h: int, w: int) -> tuple[str, Any]:
    from PIL import Image

    rng = np.random.RandomState(seed)
    image = Image.fromarray(rng.randint(0, 255, (h, w, 3), dtype=np.uint8))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode(), image


def test_images_on_a_vision_model(qwen2_vl_ckpt: Path, tmp_path: Path) -> None:
    """An image is one user message through the chat template: its last position's state, normalized, as
    transformers computes it for the same ids and pixels."""
    from transformers import Qwen2VLForConditionalGeneration

    from engine.multimodal.processing import IMAGE_PAD_ID, make_processor, process_image, read_preprocessor_config

    s = start_server(qwen2_vl_ckpt, tmp_path, "--runner", "pooling")
    try:
        url, image = png(3, 56, 84)
        co = cohere.ClientV2(api_key="none", base_url=s.url, timeout=60)
        res = co.embed(model="tiny", images=[url], input_type="image", embedding_types=["float"])
        mixed = co.embed(
            model="tiny",
            input_type="search_document",
            inputs=[
                {"content": [{"type": "text", "text": "a picture"}, {"type": "image_url", "image_url": {"url": url}}]}
            ],
        )
        content = [{"type": "image_url", "image_url": {"url": url}}]
        ids = httpx.post(
            f"{s.url}/tokenize",
            json={"messages": [{"role": "user", "content": content}], "add_generation_prompt": False},
            timeout=30,
        ).json()["tokens"]
        assert res.meta.billed_units.input_tokens == len(ids) and res.meta.billed_units.images == 1  # type: ignore[union-attr]
        px, grid = process_image(make_processor(read_preprocessor_config(qwen2_vl_ckpt)), image)
        model = Qwen2VLForConditionalGeneration.from_pretrained(qwen2_vl_ckpt, dtype=torch.float32).eval()
        t = torch.tensor([ids])
        with torch.no_grad():
            hidden = model.model(
                input_ids=t,
                pixel_values=torch.from_numpy(px),
                image_grid_thw=torch.tensor([grid]),
                mm_token_type_ids=(t == IMAGE_PAD_ID).int(),
            ).last_hidden_state[0, -1]
        np.testing.assert_allclose(
            res.embeddings.float_[0],
            torch.nn.functional.normalize(hidden, dim=-1),  # type: ignore[index]
            atol=1e-4,
        )
        assert not np.allclose(mixed.embeddings.float_[0], res.embeddings.float_[0], atol=1e-3)  # type: ignore[index]
    finally:
        s.stop()
