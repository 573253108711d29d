"""POST /v1/messages and POST /v1/messages/count_tokens: Anthropic's Messages API over the chat path.

The request is translated into a chat request (translate.py) and then takes the OpenAI chat route's path:
the same checks, renderer, admission, engine request and output processor. Only the wire format differs:
the formatter below writes Anthropic's message and event sequence, and every error (the HTTP body, or an
`error` event mid-stream) is `{"type": "error", "error": {"type", "message"}}`.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from server.api.anthropic.translate import chat_request, decode_error, stop_reason
from server.api.prompts import admit_early, prompts_lower_bound, render_chat, text_prompt_ids
from server.api.serving import PostRoute, StreamFraming, respond
from server.api.state import AppState
from server.http.asgi import ClientGone, Receive, Scope, Send, header, read_json_body, run_until_disconnect, send_json
from server.http.errors import APIError
from server.pipeline.async_llm import AsyncLLM
from server.pipeline.input_processor import ModelLimits, build_spec, check_request, external_request_id
from server.pipeline.output_processor import Output
from server.protocol.anthropic import (
    CountTokensRequest, CountTokensResponse, MessageResponse, MessageUsage, TextContent, count_tokens_decoder,
    encoder, error_body, messages_decoder,
)
from server.protocol.openai import Usage

_enc = encoder.encode


def event(kind: bytes, payload: bytes) -> bytes:
    """One server-sent event as Anthropic names them: `event: <type>` then its JSON."""
    return b"event: " + kind + b"\ndata: " + payload + b"\n\n"


PING = event(b"ping", b'{"type":"ping"}')
FRAMING = StreamFraming(done=b"", keepalive=PING,  # no [DONE]: message_stop ends an Anthropic stream
                        error=lambda e: event(b"error", error_body(e.status, e.message)))


class MessagesFormatter:
    """Anthropic's stream: message_start, content_block_start, ping, content_block_delta..., content_block_stop,
    message_delta (stop_reason, usage), message_stop. One text block: tool calls are not parsed from output."""

    def __init__(self, message_id: str, model: str, input_tokens: int) -> None:
        self.id = message_id
        self.model = model
        self.input_tokens = input_tokens

    def stream_start(self) -> bytes:
        message: dict[str, Any] = {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": 0}}
        return (event(b"message_start", _enc({"type": "message_start", "message": message}))
                + event(b"content_block_start",
                        b'{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}')
                + PING)

    def stream_chunk(self, batch: list[Output], usage: Usage | None) -> bytes | None:
        out = batch[-1]  # one choice: a batch holds its one (merged) output
        data = b""
        if out.text:
            data = event(b"content_block_delta", b'{"type":"content_block_delta","index":0,"delta":'
                                                 b'{"type":"text_delta","text":%s}}' % _enc(out.text))
        if out.finish_reason is not None:
            reason, sequence = stop_reason(out.finish_reason, out.stop_reason)
            delta = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                     "usage": {"input_tokens": self.input_tokens, "output_tokens": out.num_output_tokens}}
            data += (event(b"content_block_stop", b'{"type":"content_block_stop","index":0}')
                     + event(b"message_delta", _enc(delta)) + event(b"message_stop", b'{"type":"message_stop"}'))
        return data or None

    def usage_chunk(self, usage: Usage) -> bytes:  # never asked for: message_delta carries the usage
        return b""

    def final(self, outputs: list[Output], usage: Usage) -> bytes:
        out = outputs[0]
        reason, sequence = stop_reason(out.finish_reason, out.stop_reason)
        return _enc(MessageResponse(id=self.id, model=self.model, content=[TextContent(out.text)],
                                    stop_reason=reason, stop_sequence=sequence,
                                    usage=MessageUsage(usage.prompt_tokens, usage.completion_tokens)))


async def send_anthropic_error(send: Send, error: APIError, headers: list[tuple[bytes, bytes]]) -> None:
    extra = list(headers)
    if error.retry_after is not None:
        extra.append((b"retry-after", str(error.retry_after).encode()))
    await send_json(send, error.status, error_body(error.status, error.message), extra)


class _AnthropicRoute(PostRoute):
    """PostRoute's front (body limits, disconnect) with every error in Anthropic's shape."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        xid = header(scope, b"x-request-id")
        headers = [(b"x-request-id", xid.encode())] if xid else []
        try:
            body = await read_json_body(scope, receive, self.state.config.max_request_body)
        except ClientGone:
            return
        except APIError as e:
            await send_anthropic_error(send, e, headers)
            return

        async def guarded() -> None:
            try:
                self.check_runner()
                await self._work(body, xid, send)
            except APIError as e:
                await send_anthropic_error(send, e, headers)

        await run_until_disconnect(receive, guarded)


R = TypeVar("R", bound=CountTokensRequest)


def _decode(state: AppState, decoder: msgspec.json.Decoder[R], body: bytes) -> tuple[R, AsyncLLM, Any, ModelLimits]:
    """AppState.decode_for_model with the decode error pointing at Anthropic's reference."""
    return state.decode_for_model(decoder, body, decode_error)


class MessagesRoute(_AnthropicRoute):
    runner = "generate"

    async def _work(self, body: bytes, xid: str | None, send: Send) -> None:
        req, llm, renderer, limits = _decode(self.state, messages_decoder, body)
        chat = chat_request(req)
        check_request(chat, limits)
        external = external_request_id(xid, None)
        if llm.admission is not None:  # refuse before rendering when the queue surely has no room
            admit_early(llm, 1, 1)
        text = await render_chat(renderer, chat)
        if llm.admission is not None:
            admit_early(llm, 1, await prompts_lower_bound(renderer.tokenizer, [text]))
        ids = await text_prompt_ids(renderer, text, chat.add_special_tokens, "messages", limits)
        spec = build_spec(chat, ids, limits, external_id=external, stream=chat.stream)
        fmt = MessagesFormatter(f"msg_{external}", self.state.model_name, len(spec.prompt_token_ids))
        ids_header = external.encode()
        await respond(llm, [spec], fmt, send, stream=chat.stream, keepalive=self.state.config.sse_keepalive,
                      headers=[(b"x-request-id", ids_header), (b"request-id", ids_header)], framing=FRAMING)


class CountTokensRoute(_AnthropicRoute):
    """The prompt's tokens exactly as /v1/messages counts them (usage.input_tokens): same render, same encode."""

    async def _work(self, body: bytes, xid: str | None, send: Send) -> None:
        req, _, renderer, _ = _decode(self.state, count_tokens_decoder, body)
        chat = chat_request(req)
        text = await render_chat(renderer, chat)
        ids = await text_prompt_ids(renderer, text, chat.add_special_tokens, "messages")
        await send_json(send, 200, _enc(CountTokensResponse(len(ids))))
