"""POST /v1/chat/completions."""

from __future__ import annotations

import time
from typing import Any

import msgspec

from server.api.openai.chat_format import ChatFormatter, ParsedChatFormatter
from server.api.prompts import (
    admit_early, fit_limits, prompts_lower_bound, render_chat, require_messages, text_prompt_ids,
)
from server.api.serving import PostRoute
from server.api.app_state import AppState
from server.http.asgi import Send
from server.multimodal.images import ProcessedImage, expand_for_model, has_images, prepare_images
from server.pipeline.input_processor import build_spec, check_request, external_request_id
from server.pipeline.parsing import ChoiceParsers, plan_constrained_tools, request_constraint
from server.pipeline.structured import Relaxation, structured_outputs
from server.protocol.openai import ChatCompletionRequest, chat_decoder
from server.streaming.output_check import checked, relaxed_check, relaxed_headers
from server.streaming.reasoning_tokens import decoder
from server.streaming.respond import respond


async def chat_images(state: AppState, req: ChatCompletionRequest) -> tuple[list[ProcessedImage],
                                                                         ChatCompletionRequest]:
    """The request's images, processed, and the request with image parts as the template's markers."""
    images, messages = await prepare_images(state, req.messages or [], req.mm_processor_kwargs)
    return images, msgspec.structs.replace(req, messages=messages)


class ChatRoute(PostRoute):
    runner = "generate"

    async def _work(self, body: bytes, xid: str | None, send: Send) -> None:
        req, llm, renderer, limits = self.state.decode_for_model(chat_decoder, body)
        require_messages(req)
        check_request(req, limits)
        constraint = await structured_outputs(req, limits.caps)
        config = self.state.config
        tooling = req.tools is not None or req.tool_choice is not None or config.reasoning_parser is not None
        plan, parsed, relaxed_tools = None, False, dict[str, Relaxation]()
        if tooling:
            plan, relaxed_tools = await plan_constrained_tools(req, config, renderer.tokenizer, limits.caps, "tools")
            parsed = (plan is not None and plan.parser is not None) or config.reasoning_parser is not None
        external = external_request_id(xid, req.request_id)
        if llm.admission is not None:  # refuse before rendering when the queue surely has no room
            admit_early(llm, req.n, req.n)
        images, render_req = None, req
        if has_images(req.messages):  # decoded and preprocessed in the image worker process
            images, render_req = await chat_images(self.state, req)
        text = await render_chat(renderer, render_req)
        if llm.admission is not None:
            lower = await prompts_lower_bound(renderer.tokenizer, [text])
            admit_early(llm, req.n, req.n * lower)
        ids = await text_prompt_ids(renderer, text, req.add_special_tokens, "messages", fit_limits(req, limits))
        mm_inputs = None
        if images is not None:  # one <|image_pad|> per image -> the image's tokens, before any length check
            ids, mm_inputs = expand_for_model(ids, images, config.model_path)
        so = constraint.so if constraint is not None else None
        if tooling:
            so = request_constraint(plan, so, config, text)
        spec = build_spec(req, ids, limits, external_id=external, stream=req.stream, structured_outputs=so)
        spec.mm_inputs = mm_inputs
        texts = self.token_texts(renderer, bool(req.logprobs))
        fmt: ChatFormatter
        shown = self.state.shown_model(req.model)
        if parsed:
            fmt = ParsedChatFormatter(
                f"chatcmpl-{external}", int(time.time()), shown, req.n, texts, req.return_token_ids,
                tools=plan, reasoning=config.reasoning_parser, prompt=text,
                decode=decoder(renderer.tokenizer, spec.skip_special_tokens) if config.reasoning_parser else None)
        else:
            fmt = ChatFormatter(f"chatcmpl-{external}", int(time.time()), shown, req.n, texts,
                                req.return_token_ids)
        check = relaxed_check(llm.metrics, constraint, relaxed_tools,
                              ChoiceParsers(plan, config.reasoning_parser, text) if parsed else None)
        opts = req.stream_options
        headers = [(b"x-request-id", external.encode()), *relaxed_headers(constraint, relaxed_tools)]
        await respond(llm, [spec], checked(fmt, check), send, stream=req.stream,
                      include_usage=bool(opts and opts.include_usage),
                      continuous_usage=bool(opts and opts.include_usage and opts.continuous_usage_stats),
                      keepalive=self.state.config.sse_keepalive, headers=headers,
                      before_end=check.finish if check is not None else None)
