"""Images end to end: the official openai SDK against the real server on the tiny Qwen2-VL checkpoint."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
from PIL import Image

from engine.multimodal.processing import make_processor, num_image_tokens, process_image, read_preprocessor_config
from tests.e2e.conftest import Server, start_server


def data_url(seed: int, h: int, w: int, fmt: str = "PNG") -> str:
    rng = np.random.RandomState(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.randint(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def ask(url: str, text: str = "What is in the picture?") -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]}
    ]


@pytest.fixture(scope="module")
def vl_server(qwen2_vl_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(qwen2_vl_ckpt, tmp_path_factory.mktemp("vl"), "--limit-mm-per-prompt", '{"image": 2}')
    yield s
    s.stop()


def test_image_chat_with_the_openai_sdk(vl_server: Server, qwen2_vl_ckpt: Path) -> None:
    client = openai.OpenAI(base_url=f"{vl_server.url}/v1", api_key="none")
    url = data_url(1, 60, 90)
    kw: dict[str, Any] = dict(model="tiny", max_tokens=8, temperature=0)
    a = client.chat.completions.create(messages=ask(url), **kw)  # type: ignore[arg-type]
    b = client.chat.completions.create(messages=ask(url), **kw)  # type: ignore[arg-type]
    assert a.choices[0].message.content == b.choices[0].message.content  # the same image twice
    text = client.chat.completions.create(messages=[{"role": "user", "content": "What is in the picture?"}], **kw)
    # prompt tokens count the expanded image tokens exactly as transformers' processor does
    _, grid = process_image(
        make_processor(read_preprocessor_config(qwen2_vl_ckpt)),
        Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))),
    )
    assert a.usage is not None and text.usage is not None
    # the image turn replaces the text turn's "\n" join with the vision tokens: start, pads, end
    assert a.usage.prompt_tokens - text.usage.prompt_tokens == num_image_tokens(grid) + 2
    chunks = list(client.chat.completions.create(messages=ask(url), stream=True, **kw))  # type: ignore[arg-type]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == a.choices[0].message.content
    other = client.chat.completions.create(messages=ask(data_url(5, 60, 90, "JPEG")), **kw)  # type: ignore[arg-type]
    assert other.usage is not None and other.usage.prompt_tokens == a.usage.prompt_tokens
    gif = client.chat.completions.create(messages=ask(data_url(2, 40, 40, "GIF")), **kw)  # type: ignore[arg-type]
    assert gif.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    "url, why",
    [
        ("file:///etc/passwd", "scheme"),
        ("http://example.com/a.png", "allowed-media-domains"),
        ("data:image/png;base64,!!!", "base64"),
        ("data:image/png;base64," + base64.b64encode(b"nope").decode(), "decoded"),
    ],
)
def test_bad_images_are_400(vl_server: Server, url: str, why: str) -> None:
    client = openai.OpenAI(base_url=f"{vl_server.url}/v1", api_key="none")
    with pytest.raises(openai.BadRequestError, match=why):
        client.chat.completions.create(model="tiny", messages=ask(url), max_tokens=2)  # type: ignore[arg-type]


def test_limits(vl_server: Server) -> None:
    client = openai.OpenAI(base_url=f"{vl_server.url}/v1", api_key="none")
    url = data_url(1, 28, 28)
    three = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}] * 3}]
    with pytest.raises(openai.BadRequestError, match="limit-mm-per-prompt"):
        client.chat.completions.create(model="tiny", messages=three, max_tokens=2)  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError, match="max_pixels"):
        client.chat.completions.create(
            model="tiny",
            messages=ask(url),
            max_tokens=2,  # type: ignore[arg-type]
            extra_body={"mm_processor_kwargs": {"max_pixels": 10**9}},
        )
    small = client.chat.completions.create(
        model="tiny",
        messages=ask(data_url(1, 200, 200)),
        max_tokens=2,  # type: ignore[arg-type]
        extra_body={"mm_processor_kwargs": {"max_pixels": 56 * 56}},
    )
    big = client.chat.completions.create(model="tiny", messages=ask(data_url(1, 200, 200)), max_tokens=2)  # type: ignore[arg-type]
    assert small.usage is not None and big.usage is not None and small.usage.prompt_tokens < big.usage.prompt_tokens


def test_same_image_twice_crosses_once_and_every_route_counts_it(vl_server: Server) -> None:
    import httpx

    url = data_url(9, 56, 84)
    names = [
        "spindle_mm_processor_cache_hits_total",
        "spindle_mm_engine_cache_hits_total",
        "spindle_mm_encoder_cache_hits_total",
        "spindle_mm_engine_cache_misses_total",
    ]
    before = [vl_server.metric(n) for n in names]
    body = {"model": "tiny", "messages": ask(url), "max_tokens": 2, "temperature": 0}
    a = httpx.post(f"{vl_server.url}/v1/chat/completions", json=body, timeout=60).json()
    b = httpx.post(f"{vl_server.url}/v1/chat/completions", json=body, timeout=60).json()
    assert a["choices"][0]["message"] == b["choices"][0]["message"]
    grew = [vl_server.metric(n) - x for n, x in zip(names, before)]
    # the second time: preprocessing from the worker's cache, only the hash crossed the pipe, the engine had
    # the encoder output; nothing missed
    assert grew[:2] == [1, 1] and grew[2] >= 1 and grew[3] == 0, grew
    n = a["usage"]["prompt_tokens"]
    tok = httpx.post(f"{vl_server.url}/tokenize", json={"model": "tiny", "messages": ask(url)}, timeout=60).json()
    assert tok["count"] == n
    render = httpx.post(f"{vl_server.url}/v1/chat/completions/render", json=body, timeout=60).json()
    assert len(render["token_ids"]) == n
    blocks = [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": url.split(",", 1)[1]}},
        {"type": "text", "text": "What is in the picture?"},
    ]
    msg = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": blocks}]}
    out = httpx.post(f"{vl_server.url}/v1/messages", json=msg, timeout=60).json()
    assert out["usage"]["input_tokens"] == n, out
    count = httpx.post(f"{vl_server.url}/v1/messages/count_tokens", json=msg, timeout=60).json()
    assert count["input_tokens"] == n


def test_ollama_images_equal_the_openai_answer(vl_server: Server) -> None:
    """The official ollama client's base64 `images` (chat and templated generate) take the image path: the same
    answer and prompt tokens as the OpenAI request with the image first; on a text turn they are a 400 nowhere."""
    import ollama  # the only test here that needs it

    url = data_url(1, 60, 90)
    raw = url.split(",", 1)[1]
    client = openai.OpenAI(base_url=f"{vl_server.url}/v1", api_key="none")
    want = client.chat.completions.create(model="tiny", messages=ask(url), max_tokens=8, temperature=0)  # type: ignore[arg-type]
    ol = ollama.Client(host=vl_server.url, timeout=60)
    options = {"temperature": 0, "num_predict": 8}
    got = ol.chat(
        model="tiny",
        messages=[{"role": "user", "content": "What is in the picture?", "images": [raw]}],
        options=options,
    )
    assert got.message.content == want.choices[0].message.content
    assert want.usage is not None and got.prompt_eval_count == want.usage.prompt_tokens
    gen = ol.generate(model="tiny", prompt="What is in the picture?", images=[raw], options=options)
    assert gen.response == want.choices[0].message.content and gen.prompt_eval_count == want.usage.prompt_tokens
    assert "vision" in (ol.show("tiny").capabilities or [])
