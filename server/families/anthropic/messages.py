"""POST /v1/messages and POST /v1/messages/count_tokens: Anthropic's Messages API over the chat path.

The request is translated into a chat request (translate.py) and then takes the OpenAI chat route's path:
the same checks, renderer, admission, engine request and output processor. Only the wire format differs:
the formatter below writes Anthropic's message and event sequence, and every error (the HTTP body, or an
`error` event mid-stream) is `{"type": "error", "error": {"type", "message"}}`.
"""

from __future__ import annotations

from typing import TypeVar

import msgspec

from server.app_state import AppState
from server.config import ServerConfig
from server.families.anthropic.formatter import PING, MessagesFormatter, event
from server.families.anthropic.protocol import (
    CountTokensRequest,
    CountTokensResponse,
    count_tokens_decoder,
    encoder,
    messages_decoder,
)
from server.families.anthropic.translate import chat_request, decode_error
from server.http.asgi import Receive, Scope, Send, header, read_json_body, send_json, serve_post
from server.http.errors import APIError
from server.http.errors import anthropic_error_body as error_body
from server.multimodal.images import image_support
from server.render.renderer import Renderer
from server.request.async_llm import AsyncLLM
from server.request.formatter import StreamFraming
from server.request.input_processor import ModelLimits, external_request_id
from server.request.post_route import PostRoute
from server.request.prompt_tokens import chat_ids_with_images, chat_prompt
from server.structured.chat_plan import plan_chat, respond_checked

_enc = encoder.encode
FRAMING = StreamFraming(
    done=b"",
    keepalive=PING,  # no [DONE]: message_stop ends an Anthropic stream
    error=lambda e: event(b"error", error_body(e.status, e.message)),
)


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
        limit = self.state.config.http.max_request_body

        async def work(body: bytes) -> None:
            self.check_runner(str(scope.get("path", "")))
            await self._work(body, xid, send)

        async def error(send: Send, e: APIError) -> None:
            await send_anthropic_error(send, e, headers)

        await serve_post(receive, send, lambda: read_json_body(scope, receive, limit), work, error)


def _takes_images(config: ServerConfig) -> bool:
    return config.model.model is not None and image_support(config.model.model_path) is not None


R = TypeVar("R", bound=CountTokensRequest)


def _decode(
    state: AppState, decoder: msgspec.json.Decoder[R], body: bytes
) -> tuple[R, AsyncLLM, Renderer, ModelLimits]:
    """AppState.decode_for_model with the decode error pointing at Anthropic's reference."""
    return state.decode_for_model(decoder, body, decode_error)


class MessagesRoute(_AnthropicRoute):
    runner = "generate"

    async def _work(self, body: bytes, xid: str | None, send: Send) -> None:
        req, llm, renderer, limits = _decode(self.state, messages_decoder, body)
        config = self.state.config
        chat = chat_request(req, reasoning=config.outputs.reasoning_parser is not None, images=_takes_images(config))
        plan = await plan_chat(chat, config, renderer.tokenizer, limits, "tool_choice")
        external = external_request_id(xid, None)
        with llm.admit(1, 1) as ticket:  # the request's one ticket: a 503 now when the queue is surely full
            text, ids, mm_inputs = await chat_prompt(self.state, llm, renderer, chat, ticket, limits)
            spec = plan.spec(chat, ids, limits, external, text, mm_inputs)
            shown = self.state.shown_model(req.model)
            fmt = MessagesFormatter(f"msg_{external}", shown, len(spec.prompt_token_ids), plan.parser(text))
            ids_header = external.encode()
            headers = [(b"x-request-id", ids_header), (b"request-id", ids_header), *plan.headers()]
            keepalive = config.outputs.sse_keepalive
            check = plan.check(llm.metrics, text)
            await respond_checked(
                llm, [spec], fmt, check, send, chat, headers, ticket, framing=FRAMING, keepalive=keepalive
            )


class CountTokensRoute(_AnthropicRoute):
    """The prompt's tokens exactly as /v1/messages counts them (usage.input_tokens): same render, same encode."""

    async def _work(self, body: bytes, xid: str | None, send: Send) -> None:
        req, _, renderer, _ = _decode(self.state, count_tokens_decoder, body)
        config = self.state.config
        chat = chat_request(req, reasoning=config.outputs.reasoning_parser is not None, images=_takes_images(config))
        ids, _ = await chat_ids_with_images(self.state, renderer, chat, chat.add_special_tokens)
        await send_json(send, 200, _enc(CountTokensResponse(len(ids))))
