"""POST /api/embed (a list of inputs, L2-normalized vectors, as Ollama) and the older POST /api/embeddings (one
prompt, its raw vector) on a `--runner pooling` server: the embeddings path with Ollama's shapes."""

from __future__ import annotations

import time

from server.families.ollama.keep_alive import note_keep_alive
from server.families.ollama.protocol import embed_decoder, embeddings_decoder, encoder
from server.families.ollama.routes import OllamaRoute
from server.families.ollama.translate import decode_error, sampling
from server.families.pooling.finishing import check_dimensions, embedding
from server.families.pooling.inputs import JSONBody, PoolingJob, Truncation, require_task
from server.http.asgi import Send
from server.request.collector import Output
from server.request.openai_protocol import Usage


class EmbedFormatter(JSONBody):
    def __init__(self, model: str, dimensions: int | None, legacy: bool, load_ns: int = 0) -> None:
        self.model = model
        self.load_ns = load_ns  # the model's load time: the first request after a load reports it
        self.dimensions = dimensions
        self.legacy = legacy  # /api/embeddings: one raw vector
        self._start = time.monotonic_ns()

    def final(self, outputs: list[Output], usage: Usage) -> bytes:
        if self.legacy:
            return encoder.encode({"embedding": embedding(outputs[0], None, False).tolist()})
        vectors = [embedding(out, self.dimensions, True).tolist() for out in outputs]
        total = time.monotonic_ns() - self._start + self.load_ns
        return encoder.encode(
            {
                "model": self.model,
                "embeddings": vectors,
                "total_duration": total,
                "load_duration": self.load_ns,
                "prompt_eval_count": usage.prompt_tokens,
            }
        )


class EmbedRoute(OllamaRoute):
    runner = "pooling"

    async def _work(self, body: bytes, xid: str | None, send: Send) -> None:
        req, llm, renderer, limits = self.state.decode_for_model(embed_decoder, body, decode_error)
        note_keep_alive(self.state, req.keep_alive)
        sampling(req.options, limits)  # num_ctx checked as for generation
        info = require_task(llm, "/api/embed", ("embed",))
        items: list[str] = [req.input] if isinstance(req.input, str) else list(req.input)
        with PoolingJob.start(llm, renderer, limits, xid, None, model=req.model) as job:
            job.check_count(len(items), "input")
            dims = check_dimensions(req.dimensions, info, "dimensions")
            cut = Truncation(limits.max_model_len, "right" if req.truncate else None, "input")  # Ollama keeps the start
            await job.admit(list(items))
            for k, item in enumerate(items):
                await job.add(item, k, cut)
            fmt = EmbedFormatter(self.state.shown_model(req.model), dims, False, self.state.take_load_ns())
            await job.respond(fmt, send)


class EmbeddingsRoute(OllamaRoute):
    runner = "pooling"

    async def _work(self, body: bytes, xid: str | None, send: Send) -> None:
        req, llm, renderer, limits = self.state.decode_for_model(embeddings_decoder, body, decode_error)
        note_keep_alive(self.state, req.keep_alive)
        sampling(req.options, limits)
        require_task(llm, "/api/embeddings", ("embed",))
        with PoolingJob.start(llm, renderer, limits, xid, None, model=req.model) as job:
            await job.admit([req.prompt])
            await job.add(req.prompt, 0, Truncation(limits.max_model_len, "right", "prompt"))
            await job.respond(EmbedFormatter(self.state.shown_model(req.model), None, True), send)
