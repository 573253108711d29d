"""POST /inference/v1/generate: token ids in, token ids out (vLLM's disaggregated-serving shapes).

Request (what the /render routes answer):
    {"request_id": str?, "token_ids": [int], "sampling_params": {max_tokens?, temperature?, top_p?, top_k?,
     min_p?, n?, seed?, stop?, stop_token_ids?, ignore_eos?, min_tokens?, logprobs?, presence_penalty?,
     frequency_penalty?, repetition_penalty?, logit_bias?, allowed_token_ids?, include_stop_str_in_output?,
     skip_special_tokens?, spaces_between_special_tokens?, structured_outputs?}, "model": str?, "stream": bool?,
     "stream_options": {"include_usage"}?, "priority": int?}
Response:
    {"request_id": str, "choices": [{"index", "token_ids", "finish_reason", "stop_reason", "logprobs"}],
     "prompt_logprobs": null, "usage": {...}}
Streaming sends the same object per SSE event with each choice's new token ids, then `data: [DONE]`.
Validation is /v1/completions' (same limits, same messages); `logprobs` is top-N per token as there,
and comes back in the chat shape ({"content": [{token, logprob, bytes, top_logprobs}]}).
"""

from __future__ import annotations

from typing import Any

import msgspec

from server.http import sse
from server.http.asgi import Send
from server.request.collector import Output
from server.request.input_processor import build_spec, check_prompt_ids, check_request, external_request_id
from server.request.logprobs import TokenTexts, chat_logprobs
from server.request.openai_protocol import (
    CompletionRequest,
    Int64,
    StreamOptions,
    StructuredOutputsParams,
    Usage,
    encoder,
)
from server.request.post_route import PostRoute
from server.request.respond import respond
from server.structured.constraint import structured_outputs
from server.structured.output_check import relaxed_headers

_enc = encoder.encode


class GenerateSamplingParams(msgspec.Struct, kw_only=True):
    max_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    n: Int64 = 1
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int64] | None = None
    ignore_eos: bool = False
    min_tokens: Int64 = 0
    logprobs: Int64 | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[Int64] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None  # vLLM's: json, regex, choice, grammar, json_object


class GenerateRequest(msgspec.Struct, kw_only=True):
    token_ids: list[Int64]
    request_id: str | None = None
    sampling_params: GenerateSamplingParams = msgspec.field(default_factory=GenerateSamplingParams)
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: Int64 = 0


class GenerateChoice(msgspec.Struct):
    index: int
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: Any = None


class GenerateResponse(msgspec.Struct):
    request_id: str
    choices: list[GenerateChoice]
    prompt_logprobs: None = None
    usage: Usage | None = None


_decoder = msgspec.json.Decoder(GenerateRequest)


def as_completion_request(req: GenerateRequest) -> CompletionRequest:
    """The same request as /v1/completions with a token-id prompt, so it is validated the same way."""
    fields = {f: getattr(req.sampling_params, f) for f in req.sampling_params.__struct_fields__}
    return CompletionRequest(
        prompt=req.token_ids,
        stream=req.stream,
        stream_options=req.stream_options,
        priority=req.priority,
        request_id=req.request_id,
        model=req.model,
        **fields,
    )


class GenerateFormatter:
    direct_ok = True  # stateless per output: the output handler may write chunks itself

    def __init__(self, request_id: str, texts: TokenTexts | None) -> None:
        self.id = request_id
        self.texts = texts

    def _choices(self, outputs: list[Output]) -> list[GenerateChoice]:
        return [
            GenerateChoice(
                o.index,
                o.token_ids,
                o.finish_reason,
                o.stop_reason,
                chat_logprobs(o.logprobs or [], self.texts) if self.texts is not None else None,
            )
            for o in outputs
        ]

    def stream_start(self) -> bytes | None:
        return None

    def stream_chunk(self, batch: list[Output], usage: Usage | None) -> bytes | None:
        return sse.frame(_enc(GenerateResponse(self.id, self._choices(batch), usage=usage)))

    def usage_chunk(self, usage: Usage) -> bytes:
        return sse.frame(_enc(GenerateResponse(self.id, [], usage=usage)))

    def final(self, outputs: list[Output], usage: Usage) -> bytes:
        return _enc(GenerateResponse(self.id, self._choices(outputs), usage=usage))


class GenerateRoute(PostRoute):
    runner = "generate"

    async def _work(self, body: bytes, xid: str | None, send: Send) -> None:
        raw, llm, renderer, limits = self.state.decode_for_model(_decoder, body)
        req = as_completion_request(raw)
        check_request(req, limits)
        check_prompt_ids(raw.token_ids, limits.vocab_size, "token_ids")
        constraint = await structured_outputs(req, limits.caps, prefix="sampling_params.", tokenizer=renderer.tokenizer)
        external = external_request_id(xid, raw.request_id)
        spec = build_spec(
            req,
            list(raw.token_ids),
            limits,
            external_id=external,
            stream=raw.stream,
            structured_outputs=constraint.so if constraint is not None else None,
        )
        texts = self.token_texts(renderer, req.logprobs is not None)
        opts = raw.stream_options
        await respond(
            llm,
            [spec],
            GenerateFormatter(external, texts),
            send,
            stream=raw.stream,
            include_usage=bool(opts and opts.include_usage),
            keepalive=self.state.config.outputs.sse_keepalive,
            headers=[(b"x-request-id", external.encode()), *relaxed_headers(constraint, {})],
        )
