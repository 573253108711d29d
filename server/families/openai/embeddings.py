"""POST /v1/embeddings (OpenAI's shape, vLLM's extras) on a `--runner pooling` embedding server.

The engine pools (engine/execution/pooler.py: `--pooler-config`, a sentence-transformers layout) and reports each
input's
raw vector once; this route shapes the answer: the Matryoshka cut (`dimensions`, where the model declares it),
L2 normalization (the model's default, or the request's `normalize`), floats or base64 (little-endian float32,
as OpenAI), `truncate_prompt_tokens` (keep the last k tokens).
"""

from __future__ import annotations

from server.families.pooling.finishing import check_dimensions, embedding, encode_vector
from server.families.pooling.inputs import JSONBody, PoolingJob, input_items, prompt_truncation, require_task
from server.http.asgi import Send
from server.request.collector import Output
from server.request.openai_protocol import (
    EmbeddingData,
    EmbeddingResponse,
    EmbeddingUsage,
    Usage,
    embedding_decoder,
    encoder,
)
from server.request.post_route import PostRoute


class EmbeddingFormatter(JSONBody):
    def __init__(self, model: str, dimensions: int | None, normalize: bool, b64: bool) -> None:
        self.model = model
        self.dimensions = dimensions
        self.normalize = normalize
        self.b64 = b64

    def final(self, outputs: list[Output], usage: Usage) -> bytes:
        data = [
            EmbeddingData(out.index, encode_vector(embedding(out, self.dimensions, self.normalize), self.b64))
            for out in outputs
        ]
        return encoder.encode(
            EmbeddingResponse(data, self.model, EmbeddingUsage(usage.prompt_tokens, usage.prompt_tokens))
        )


class EmbeddingsRoute(PostRoute):
    runner = "pooling"

    async def _work(self, body: bytes, xid: str | None, send: Send) -> None:
        req, llm, renderer, limits = self.state.decode_for_model(embedding_decoder, body)
        info = require_task(llm, "/v1/embeddings", ("embed",))
        items = input_items(req.input)
        with PoolingJob.start(
            llm, renderer, limits, xid, None, add_special_tokens=req.add_special_tokens, model=req.model
        ) as job:
            job.check_count(len(items), "input")
            dims = check_dimensions(req.dimensions, info, "dimensions")
            cut = prompt_truncation(req.truncate_prompt_tokens, limits)
            await job.admit(items)
            for k, item in enumerate(items):
                await job.add(item, k, cut)
            normalize = info.normalize if req.normalize is None else req.normalize
            fmt = EmbeddingFormatter(
                self.state.shown_model(req.model), dims, normalize, req.encoding_format == "base64"
            )
            await job.respond(fmt, send)
