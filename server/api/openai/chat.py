"""POST /v1/chat/completions."""

from __future__ import annotations

import time
from typing import Any

import msgspec

from engine.messages import ImageInput
from server.api.openai.chat_format import ChatFormatter, ParsedChatFormatter
from server.api.prompt_tokens import admit_prompts, fit_limits, render_chat, require_messages, text_prompt_ids
from server.api.serving import PostRoute
from server.api.app_state import AppState, Renderer
from server.http.asgi import Send
from server.multimodal.images import ProcessedImage, expand_for_model, has_images, prepare_images
from server.pipeline.admission import AdmissionTicket
from server.pipeline.async_llm import AsyncLLM
from server.pipeline.input_processor import ModelLimits, build_spec, check_request, external_request_id
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

    async def _prompt(self, req: ChatCompletionRequest, llm: AsyncLLM, renderer: Renderer, limits: ModelLimits,
                      ticket: AdmissionTicket) -> tuple[str, list[int], list[ImageInput] | None]:
        """The rendered prompt, its ids (each image's placeholder expanded) and its images for the engine; the
        ticket resized to the rendered prompt's lower bound before it is tokenized."""
        images, render_req = None, req
        if has_images(req.messages):  # decoded and preprocessed in the image worker process
            images, render_req = await chat_images(self.state, req)
        text = await render_chat(renderer, render_req)
        await admit_prompts(llm, req.n, [text], renderer.tokenizer, ticket)
        ids = await text_prompt_ids(renderer, text, req.add_special_tokens, "messages", fit_limits(req, limits))
        mm_inputs = None
        if images is not None:  # one <|image_pad|> per image -> the image's tokens, before any length check
            ids, mm_inputs = expand_for_model(ids, images, self.state.config.model.model_path)
        return text, ids, mm_inputs

    async def _work(self, body: bytes, xid: str | None, send: Send) -> None:
        req, llm, renderer, limits = self.state.decode_for_model(chat_decoder, body)
        require_messages(req)
        check_request(req, limits)
        constraint = await structured_outputs(req, limits.caps)
        config = self.state.config
        tooling = req.tools is not None or req.tool_choice is not None or config.outputs.reasoning_parser is not None
        plan, parsed, relaxed_tools = None, False, dict[str, Relaxation]()
        if tooling:
            plan, relaxed_tools = await plan_constrained_tools(req, config, renderer.tokenizer, limits.caps, "tools")
            parsed = (plan is not None and plan.parser is not None) or config.outputs.reasoning_parser is not None
        external = external_request_id(xid, req.request_id)
        with llm.admit(req.n, req.n) as ticket:  # the request's one ticket: a 503 now when the queue is surely full
            text, ids, mm_inputs = await self._prompt(req, llm, renderer, limits, ticket)
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
                    tools=plan, reasoning=config.outputs.reasoning_parser, prompt=text,
                    decode=decoder(renderer.tokenizer, spec.skip_special_tokens) if config.outputs.reasoning_parser else None)
            else:
                fmt = ChatFormatter(f"chatcmpl-{external}", int(time.time()), shown, req.n, texts,
                                    req.return_token_ids)
            check = relaxed_check(llm.metrics, constraint, relaxed_tools,
                                  ChoiceParsers(plan, config.outputs.reasoning_parser, text) if parsed else None)
            opts = req.stream_options
            headers = [(b"x-request-id", external.encode()), *relaxed_headers(constraint, relaxed_tools)]
            await respond(llm, [spec], checked(fmt, check), send, stream=req.stream,
                          include_usage=bool(opts and opts.include_usage),
                          continuous_usage=bool(opts and opts.include_usage and opts.continuous_usage_stats),
                          keepalive=self.state.config.outputs.sse_keepalive, headers=headers,
                          before_end=check.finish if check is not None else None, ticket=ticket)
