"""POST /v2/embed (Cohere's v2 embed API) on a `--runner pooling` embedding server.

`texts` are embedded as plain text, after the prompt `input_type` maps to (server/families/cohere/input_types.py).
`images` (data URIs) and `inputs` holding an image go through the model's chat template as one user message of
their parts (a vision model; a 400 on a text-only one), as vLLM embeds chat-style inputs; an `inputs` item of text
only is its text parts joined by newlines, as `texts`. `truncate` END (the default) drops a too-long input's end,
START its start, NONE refuses it; the limit is `max_tokens` or the context length. `output_dimension` is the
Matryoshka cut; the embeddings come back in each of `embedding_types` (server/families/cohere/quantize.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from engine.messages import PoolingInfo
from server.families.cohere.input_types import prompt_for
from server.families.cohere.protocol import (
    ApiMeta,
    ApiVersion,
    BilledUnits,
    EmbedInput,
    EmbedRequest,
    EmbedResponse,
    ImageUrlContent,
    TextContent,
    embed_decoder,
)
from server.families.cohere.quantize import EMBEDDING_TYPES, quantize
from server.families.pooling.finishing import check_dimensions, embedding
from server.families.pooling.inputs import JSONBody, PoolingJob, Truncation, require_task
from server.http.asgi import Send
from server.http.errors import APIError, bad_request
from server.request.collector import Output
from server.request.input_processor import ModelLimits
from server.request.openai_protocol import ChatCompletionRequest, Usage, encoder
from server.request.post_route import PostRoute
from server.request.prompt_tokens import chat_ids_with_images

_SIDES = {"NONE": None, "START": "left", "END": "right"}


def embed_items(req: EmbedRequest) -> tuple[str, list[Any]]:
    """Which of texts / images / inputs the request uses (exactly one, non-empty), and its items."""
    given = [
        (name, value)
        for name, value in (("texts", req.texts), ("images", req.images), ("inputs", req.inputs))
        if value is not None
    ]
    if len(given) != 1:
        raise bad_request(
            "Send one of texts, images or inputs" + (f"; got {', '.join(n for n, _ in given)}." if given else "."),
            "texts",
        )
    name, items = given[0]
    if not items:
        raise bad_request(f"{name} must not be empty.", name)
    return name, list(items)


def embed_types(req: EmbedRequest) -> list[str]:
    kinds = req.embedding_types if req.embedding_types is not None else ["float"]
    bad = [k for k in kinds if k not in EMBEDDING_TYPES]
    if bad or not kinds:
        raise bad_request(
            f"embedding_types must be a non-empty list of {', '.join(EMBEDDING_TYPES)}; got {bad or kinds}.",
            "embedding_types",
        )
    return list(dict.fromkeys(kinds))


def truncation(req: EmbedRequest, limits: ModelLimits, param: str) -> Truncation:
    mode = (req.truncate or "END").upper()
    if mode not in _SIDES:
        raise bad_request(f"truncate must be NONE, START or END, got {req.truncate!r}.", "truncate")
    if req.max_tokens is not None and req.max_tokens < 1:
        raise bad_request(f"max_tokens must be at least 1, got {req.max_tokens}.", "max_tokens")
    limit = min(req.max_tokens or limits.max_model_len, limits.max_model_len)
    name = "max_tokens" if limit < limits.max_model_len else "This model's maximum context length"
    return Truncation(limit, _SIDES[mode], param, name)


def input_parts(item: EmbedInput) -> tuple[str | None, list[dict[str, Any]]]:
    """An `inputs` item: its text (text parts only) or its chat content parts (with an image)."""
    if not item.content:
        raise bad_request("each of inputs needs at least one content part.", "inputs")
    if all(isinstance(p, TextContent) for p in item.content):
        return "\n".join(p.text for p in item.content if isinstance(p, TextContent)), []
    parts = [
        {"type": "text", "text": p.text}
        if isinstance(p, TextContent)
        else {"type": "image_url", "image_url": {"url": p.image_url.url}}
        for p in item.content
        if isinstance(p, (TextContent, ImageUrlContent))
    ]
    return None, parts


class CohereEmbedFormatter(JSONBody):
    def __init__(
        self, job: PoolingJob, kinds: list[str], dims: int | None, normalize: bool, texts: list[str] | None, images: int
    ) -> None:
        self.job, self.kinds, self.dims, self.normalize = job, kinds, dims, normalize
        self.texts, self.images = texts, images

    def final(self, outputs: list[Output], usage: Usage) -> bytes:
        e = np.stack([embedding(out, self.dims, self.normalize) for out in outputs])
        billed = BilledUnits(input_tokens=usage.prompt_tokens, images=self.images or None)
        return encoder.encode(
            EmbedResponse(
                self.job.external, {k: quantize(e, k) for k in self.kinds}, ApiMeta(ApiVersion(), billed), self.texts
            )
        )


class CohereEmbedRoute(PostRoute):
    runner = "pooling"

    async def _work(self, body: bytes, xid: str | None, send: Send) -> None:
        req, llm, renderer, limits = self.state.decode_for_model(embed_decoder, body)
        info = require_task(llm, "/v2/embed", ("embed",))
        name, items = embed_items(req)
        kinds = embed_types(req)
        dims = check_dimensions(req.output_dimension, info, "output_dimension")
        prompt = prompt_for(req.input_type, info)
        cut = truncation(req, limits, name)
        with PoolingJob.start(llm, renderer, limits, xid, None, req.priority, model=req.model) as job:
            job.check_count(len(items), name)
            images = await self._add_all(job, info, name, items, prompt, cut)
            texts = list(items) if name == "texts" else None
            await job.respond(CohereEmbedFormatter(job, kinds, dims, info.normalize, texts, images), send)

    async def _add_all(
        self, job: PoolingJob, info: PoolingInfo, name: str, items: list[Any], prompt: str, cut: Truncation
    ) -> int:
        """Queue every item; returns how many images they hold."""
        if name == "texts":
            await job.admit([prompt + t for t in items])
        images = 0
        for k, item in enumerate(items):
            text, parts = (
                (None, [{"type": "image_url", "image_url": {"url": item}}])
                if name == "images"
                else (item, [])
                if name == "texts"
                else input_parts(item)
            )
            if text is not None:
                await job.add(prompt + text, k, cut, what=name[:-1])
                continue
            images += sum(p["type"] == "image_url" for p in parts)
            await self._add_chat(job, parts, prompt, k, name)
        return images

    async def _add_chat(self, job: PoolingJob, parts: list[dict[str, Any]], prompt: str, k: int, name: str) -> None:
        """Parts with an image: one user message through the chat template, its image placeholders expanded."""
        content = ([{"type": "text", "text": prompt}] if prompt else []) + parts
        chat = ChatCompletionRequest(messages=[{"role": "user", "content": content}], add_generation_prompt=False)
        try:
            ids, mm = await chat_ids_with_images(self.state, job.renderer, chat, False, job.limits)
        except APIError as e:  # worded for chat messages: name this request's field
            e.param = name
            raise
        job.add_ids(ids, k, name, name[:-1], mm)
