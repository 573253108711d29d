"""POST /v1/embeddings (OpenAI's shape) on a `--runner pooling` server: one engine request per input.

The engine pools the final norm's output (engine/pooler.py, `--pooler-config`) and reports each embedding once,
with finish_reason "stop", when the input is fully processed; this route only shapes the answer: floats or
base64 (little-endian float32, as OpenAI), and Matryoshka truncation (`dimensions`) where the model declares it.
"""

from __future__ import annotations

import base64
import time
from typing import Any

import numpy as np

from engine.messages import Ready, SamplingParams
from server.api.prompts import admit_early, prompts_lower_bound, render_errors, text_prompt_ids
from server.api.serving import PostRoute
from server.streaming.respond import respond
from server.http.asgi import Send
from server.http.errors import APIError, bad_request
from server.pipeline.input_processor import (
    GenerationSpec, ModelLimits, OutputKind, check_prompt_ids, external_request_id, unique_prefix,
)
from server.pipeline.output_processor import Output
from server.protocol.openai import (
    EmbeddingData, EmbeddingResponse, EmbeddingUsage, Usage, embedding_decoder, encoder,
)

_ONE = SamplingParams(max_tokens=1)  # the engine runs the prompt only (runner "pooling" ignores max_tokens)


def embedding_inputs(value: str | list[Any]) -> list[str | list[int]]:
    """The four `input` shapes -> one text or token-id list per embedding."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise bad_request("input must not be an empty list.", "input")
    if all(isinstance(v, str) for v in value):
        return list(value)
    if all(type(v) is int for v in value):
        return [list(value)]
    if all(isinstance(v, list) and v and all(type(t) is int for t in v) for v in value):
        return [list(v) for v in value]
    raise bad_request("input must be a string, a list of strings, a list of token ids, or a list of non-empty "
                      "token-id lists; do not mix them.", "input")


def output_dimensions(requested: int | None, ready: Ready, pooler_config: dict[str, Any]) -> int | None:
    """`dimensions`, checked against the model's Matryoshka declaration (config.json or --pooler-config)."""
    if requested is None:
        return None
    allowed = pooler_config.get("matryoshka_dimensions", ready.matryoshka_dimensions)
    if not pooler_config.get("is_matryoshka", ready.is_matryoshka) and allowed is None:
        raise bad_request("This model does not support Matryoshka representation, so dimensions cannot change "
                          "the embedding size; leave dimensions out (a checkpoint declares it with config.json's "
                          "matryoshka_dimensions, or the server with --pooler-config "
                          "'{\"is_matryoshka\": true}').", "dimensions")
    if not 1 <= requested <= ready.hidden_size:
        raise bad_request(f"dimensions must be between 1 and {ready.hidden_size}, got {requested}.", "dimensions")
    if allowed is not None and requested not in allowed:
        raise bad_request(f"This model supports dimensions {sorted(allowed)} only, got {requested}.", "dimensions")
    return requested


def _check_length(n: int, k: int, limits: ModelLimits) -> None:
    if n == 0:
        raise bad_request(f"input {k} is empty after tokenization; send at least one token.", "input")
    if n > limits.max_model_len:
        raise bad_request(f"This model's maximum context length is {limits.max_model_len} tokens. However, input "
                          f"{k} has {n} tokens. Please reduce the length of the input.", "input")


class EmbeddingFormatter:
    """`respond`'s formatter for the one JSON body (embeddings never stream)."""

    direct_ok = True  # never streamed: nothing to write directly

    def __init__(self, model: str, dimensions: int | None, normalize: bool, b64: bool) -> None:
        self.model = model
        self.dimensions = dimensions
        self.normalize = normalize
        self.b64 = b64

    def _vector(self, out: Output) -> list[float] | str:
        if out.embedding is None:
            raise APIError("the engine returned no embedding; is it running with --runner pooling?", status=500)
        if self.dimensions is None and not self.b64:
            return out.embedding
        v = np.asarray(out.embedding, dtype=np.float32)
        if self.dimensions is not None:
            v = v[:self.dimensions]
            if self.normalize:  # truncation then L2 normalization, as vLLM and OpenAI's text-embedding-3
                v = v / max(float(np.linalg.norm(v)), 1e-12)
        if self.b64:
            return base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")
        values: list[float] = v.tolist()
        return values

    def final(self, outputs: list[Output], usage: Usage) -> bytes:
        data = [EmbeddingData(out.index, self._vector(out)) for out in outputs]
        return encoder.encode(EmbeddingResponse(data, self.model,
                                                EmbeddingUsage(usage.prompt_tokens, usage.prompt_tokens)))

    def stream_start(self) -> bytes | None:
        return None

    def stream_chunk(self, batch: list[Output], usage: Usage | None) -> bytes | None:
        return None

    def usage_chunk(self, usage: Usage) -> bytes:
        return b""


class EmbeddingsRoute(PostRoute):
    runner = "pooling"

    async def _work(self, body: bytes, xid: str | None, send: Send) -> None:
        req, llm, renderer, limits = self.state.decode_for_model(embedding_decoder, body)
        inputs = embedding_inputs(req.input)
        cap = limits.caps.max_prompts_per_request
        if len(inputs) > cap:
            raise bad_request(f"Number of inputs: {len(inputs)}, but this server allows at most {cap} per request "
                              "(--max-prompts-per-request).", "input")
        pooler = self.state.config.pooler_config
        dims = output_dimensions(req.dimensions, llm.ready, pooler)
        external = external_request_id(xid, None)
        if llm.admission is not None:  # refuse before tokenizing when the queue surely has no room
            admit_early(llm, len(inputs), await prompts_lower_bound(renderer.tokenizer, inputs))
        specs = []
        with render_errors("input"):
            for k, item in enumerate(inputs):
                if isinstance(item, str):
                    # a text surely too long is refused before tokenizing (the bound is at least 1)
                    _check_length(await prompts_lower_bound(renderer.tokenizer, [item]), k, limits)
                    ids = await text_prompt_ids(renderer, item, req.add_special_tokens, "input")
                else:
                    check_prompt_ids(item, limits.vocab_size, "input")
                    ids = item
                _check_length(len(ids), k, limits)
                specs.append(GenerationSpec(external_id=external, request_id=f"{unique_prefix()}-{external}",
                                            prompt_token_ids=ids, params=_ONE, output_kind=OutputKind.FINAL_ONLY,
                                            arrival_time=time.time(), index_offset=k))
        fmt = EmbeddingFormatter(self.state.model_name, dims, bool(pooler.get("normalize", True)),
                                 req.encoding_format == "base64")
        await respond(llm, specs, fmt, send, stream=False, headers=[(b"x-request-id", external.encode())])
