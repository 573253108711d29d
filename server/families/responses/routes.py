"""POST /v1/responses, GET / DELETE /v1/responses/{response_id}, POST /v1/responses/{response_id}/cancel:
OpenAI's Responses API over the chat path.

The request is translated into a chat request (server/families/responses/items.py) and then takes the chat
route's path: the same checks, renderer, admission, tool plan and constraint, engine request and output
processor. Only the wire format differs (server/families/responses/formatter.py); with `store` the finished
response is kept (responses_store.py) for previous_response_id and GET.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from server.app_state import AppState
from server.families.responses.background import BackgroundResponses
from server.families.responses.context import Prompt, fit_prompt, resolve_references
from server.families.responses.events import new_id
from server.families.responses.formatter import ResponsesFormatter
from server.families.responses.items import LOGPROBS, chat_request, input_items, responses_error
from server.families.responses.protocol import ResponsesRequest, encoder, responses_decoder
from server.families.responses.store import ResponseStore, StoredResponse
from server.http.asgi import Receive, Scope, Send, send_error, send_json
from server.http.errors import APIError
from server.multimodal.images import image_support
from server.reasoning.token_count import decoder
from server.render.renderer import Renderer
from server.request.admission import AdmissionTicket
from server.request.async_llm import AsyncLLM
from server.request.collector import Output
from server.request.formatter import StreamFraming
from server.request.input_processor import GenerationSpec, ModelLimits, external_request_id
from server.request.logprobs import chat_logprobs
from server.request.openai_protocol import ChatCompletionRequest
from server.request.post_route import PostRoute
from server.request.prompt_tokens import chat_prompt
from server.structured.chat_plan import ChatPlan, plan_chat, respond_checked

_enc = encoder.encode


def framing(fmt: ResponsesFormatter) -> StreamFraming:
    """No [DONE] (response.completed ends the stream); an error event numbered after the events before it."""

    def error(e: APIError) -> bytes:
        body = _enc(
            {
                "type": "error",
                "code": str(e.status),
                "message": e.message,
                "param": e.param,
                "sequence_number": fmt.builder.seq,
            }
        )
        return b"event: error\ndata: " + body + b"\n\n"

    return StreamFraming(done=b"", error=error)


def response_base(req: ResponsesRequest, response_id: str, model: str) -> dict[str, Any]:
    """The response object's fields that echo the request."""
    fmt = req.text.format if req.text is not None and req.text.format is not None else {"type": "text"}
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "model": model,
        "error": None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata or {},
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "tools": req.tools or [],
        "tool_choice": req.tool_choice or "auto",
        "text": {"format": fmt},
        "truncation": req.truncation or "disabled",
        "store": req.store,
        "user": req.user,
        "background": req.background,
        "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
    }


class ResponsesRoute(PostRoute):
    runner = "generate"

    def __init__(self, state: AppState, store: ResponseStore, background: BackgroundResponses) -> None:
        super().__init__(state)
        self.store = store
        self.background = background

    async def _work(self, body: bytes, xid: str | None, send: Send) -> None:
        try:
            await self._respond(body, xid, send)
        except APIError as e:
            raise responses_error(e) from None

    async def _respond(self, body: bytes, xid: str | None, send: Send) -> None:
        req, llm, renderer, limits = self.state.decode_for_model(responses_decoder, body)
        config = self.state.config
        history, given, chat = await self._chat(req)
        plan = await plan_chat(chat, config, renderer.tokenizer, limits, "tool_choice")
        if plan.tools is not None and plan.tools.constraint is not None:  # a forced call writes no text: format moot
            plan = plan.without_format()
        external = external_request_id(xid, None)
        with llm.admit(1, 1) as ticket:  # the request's one ticket: a 503 now when the queue is surely full
            text, ids, mm_inputs = await self._prompt(req, chat, llm, renderer, limits, ticket)
            spec = plan.spec(chat, ids, limits, external, text, mm_inputs)
            fmt = self._formatter(req, chat, spec, renderer, plan, text)
            check = plan.check(llm.metrics, text)
            headers = [(b"x-request-id", external.encode()), *plan.headers()]

            async def before_end() -> None:  # stored before the client sees the end: its next request may use it
                if check is not None:
                    await check.finish()
                if req.store and fmt.done is not None:
                    items = [*history, *given, *fmt.done["output"]]  # history: stored once, with the previous
                    await self.store.put(StoredResponse(fmt.done, items, req.previous_response_id, len(history)))

            async def run(to: Send) -> None:
                keepalive = config.outputs.sse_keepalive
                await respond_checked(
                    llm,
                    [spec],
                    fmt,
                    check,
                    to,
                    chat,
                    headers,
                    ticket,
                    framing=framing(fmt),
                    keepalive=keepalive,
                    before_end=before_end,
                )

            await (self.background.start(fmt.base, run, send, ticket) if req.background else run(send))

    async def _chat(self, req: ResponsesRequest) -> tuple[list[Any], list[Any], ChatCompletionRequest]:
        """The previous response's items, this request's input items (references resolved) and the chat request
        made of both."""
        config = self.state.config
        history = [] if req.previous_response_id is None else await self.store.history(req.previous_response_id)
        images = config.model.model is not None and image_support(config.model.model_path) is not None
        given = await resolve_references(input_items(req), self.store)
        return history, given, chat_request(req, history, images=images, given=given)

    async def _prompt(
        self,
        req: ResponsesRequest,
        chat: ChatCompletionRequest,
        llm: AsyncLLM,
        renderer: Renderer,
        limits: ModelLimits,
        ticket: AdmissionTicket,
    ) -> Prompt:
        """The rendered prompt; with truncation "auto" that of the longest conversation suffix that fits."""
        if req.truncation == "auto":  # (responses_context.py)
            return await fit_prompt(  # candidates: generate settles the ticket at the exact count
                chat, limits, lambda c: chat_prompt(self.state, llm, renderer, c, None, None, "input")
            )
        return await chat_prompt(self.state, llm, renderer, chat, ticket, limits, "input")

    def _formatter(
        self,
        req: ResponsesRequest,
        chat: ChatCompletionRequest,
        spec: GenerationSpec,
        renderer: Renderer,
        plan: ChatPlan,
        text: str,
    ) -> ResponsesFormatter:
        """The wire format of this response: its parsers (tool calls, reasoning) and logprobs writer."""
        config = self.state.config
        if chat.logprobs and plan.parsed:
            raise APIError(
                f"include {LOGPROBS!r} is not supported yet with a tool call or reasoning parser at "
                "work (tools or --reasoning-parser).",
                status=400,
                param="include",
            )
        texts = self.token_texts(renderer, chat.logprobs)

        def logprobs(out: Output) -> list[dict[str, Any]]:
            assert texts is not None
            return [msgspec.to_builtins(lp) for lp in chat_logprobs(out.logprobs or [], texts).content or []]

        decode = decoder(renderer.tokenizer, spec.skip_special_tokens) if config.outputs.reasoning_parser else None
        return ResponsesFormatter(
            response_base(req, new_id("resp"), self.state.shown_model(req.model)),
            len(spec.prompt_token_ids),
            lambda: plan.parser(text),
            logprobs if texts is not None else None,
            decode,
        )


class StoredResponseRoute:
    """GET (the stored response) and DELETE /v1/responses/{response_id}; POST .../cancel (`cancel`)."""

    def __init__(self, store: ResponseStore, background: BackgroundResponses | None = None) -> None:
        self.store = store
        self.background = background  # set: this is POST .../cancel

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        response_id = scope["path_params"]["response_id"]
        try:
            if self.background is not None:
                await send_json(send, 200, _enc(await self.background.cancel(response_id)))
                return
            if scope["method"] == "DELETE":
                await self.store.delete(response_id)
                await send_json(send, 200, _enc({"id": response_id, "object": "response.deleted", "deleted": True}))
                return
            await send_json(send, 200, _enc((await self.store.get(response_id)).response))
        except APIError as e:
            await send_error(send, e)
