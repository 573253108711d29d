"""POST /v1/chat/completions."""

from __future__ import annotations

import time
from typing import Any

import msgspec

from server.api.openai.logprobs import TokenTexts, chat_logprobs
from server.api.prompts import (
    admit_early, fit_limits, prompts_lower_bound, render_chat, require_messages, text_prompt_ids,
)
from server.api.serving import PostRoute, respond
from server.http import sse
from server.multimodal.images import (
    ProcessedImage, expand, has_images, image_support, prepare_images,
)
from server.http.asgi import Send
from server.pipeline.input_processor import build_spec, check_request, external_request_id
from server.pipeline.output_processor import Output
from server.pipeline.structured import check_constraint, structured_outputs
from server.protocol.openai import (
    ChatChoice, ChatChoiceIds, ChatCompletionResponse, ChatCompletionStreamResponse, ChatMessage, ChatStreamChoice, ChatStreamChoiceIds,
    DeltaMessage,
    Usage, chat_decoder, encoder,
)

_enc = encoder.encode


class ChatFormatter:
    def __init__(self, request_id: str, created: int, model: str, n: int, texts: TokenTexts | None,
                 token_ids: bool = False) -> None:
        self.id = request_id
        self.created = created
        self.model = model
        self.n = n
        self.texts = texts  # set when logprobs were asked for
        self.token_ids = token_ids  # return_token_ids
        self._plain = texts is None and not token_ids
        head = _enc({"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model})
        self._prefix = b"data: " + head[:-1] + b',"choices":['

    def stream_start(self) -> bytes:
        """The first chunk of every choice carries the role, as OpenAI sends it."""
        choices = b",".join(b'{"index":%d,"delta":{"role":"assistant","content":""},"logprobs":null,'
                            b'"finish_reason":null}' % i for i in range(self.n))
        return self._prefix + choices + b"]}\n\n"

    def stream_chunk(self, batch: list[Output], usage: Usage | None) -> bytes | None:
        if usage is None and len(batch) == 1 and self._plain and batch[0].finish_reason is None:
            return b"%s%s]}\n\n" % (self._prefix, self._plain_choice(batch[0]))  # the per-token case
        parts = []
        for out in batch:
            if out.finish_reason is None and self._plain:
                parts.append(self._plain_choice(out))
            else:
                lp = chat_logprobs(out.logprobs or [], self.texts) if self.texts is not None else None
                if self.token_ids:
                    parts.append(_enc(ChatStreamChoiceIds(out.index, DeltaMessage(content=out.text), lp,
                                                          out.finish_reason, out.stop_reason, out.token_ids)))
                else:
                    parts.append(_enc(ChatStreamChoice(out.index, DeltaMessage(content=out.text), lp,
                                                       out.finish_reason, out.stop_reason)))
        tail = b"]}\n\n" if usage is None else b'],"usage":' + _enc(usage) + b"}\n\n"
        return self._prefix + b",".join(parts) + tail

    def _plain_choice(self, out: Output) -> bytes:  # the hot path: no objects, one encode
        return b'{"index":%d,"delta":{"content":%s},"logprobs":null,"finish_reason":null}' % (out.index, _enc(out.text))

    def usage_chunk(self, usage: Usage) -> bytes:
        return sse.frame(_enc(ChatCompletionStreamResponse(self.id, self.created, self.model, [], usage=usage)))

    def final(self, outputs: list[Output], usage: Usage) -> bytes:
        choices: list[ChatChoice] = []
        for o in outputs:
            lp = chat_logprobs(o.logprobs or [], self.texts) if self.texts is not None else None
            message = ChatMessage("assistant", o.text)
            if self.token_ids:
                choices.append(ChatChoiceIds(o.index, message, lp, o.finish_reason, o.stop_reason, o.token_ids))
            else:
                choices.append(ChatChoice(o.index, message, lp, o.finish_reason, o.stop_reason))
        return _enc(ChatCompletionResponse(self.id, self.created, self.model, choices, usage))


async def chat_images(state: Any, req: Any) -> tuple[list[ProcessedImage], Any]:
    """The request's images, processed, and the request with image parts as the template's markers."""
    images, messages = await prepare_images(state, req.messages, req.mm_processor_kwargs)
    return images, msgspec.structs.replace(req, messages=messages)


class ChatRoute(PostRoute):
    runner = "generate"

    async def _work(self, body: bytes, xid: str | None, send: Send) -> None:
        req, llm, renderer, limits = self.state.decode_for_model(chat_decoder, body)
        require_messages(req)
        check_request(req, limits)
        constraint = await structured_outputs(req, limits.caps)
        config = self.state.config
        # tool calling / reasoning: server/api/openai/chat_parsing.py (imported here: it builds on ChatFormatter)
        from server.api.openai import chat_parsing

        tooling = req.tools is not None or req.tool_choice is not None or config.reasoning_parser is not None
        plan, parsed = None, False
        if tooling:
            plan = chat_parsing.plan_request_tools(req, config, renderer.tokenizer)
            if plan is not None and plan.constraint is not None:
                await check_constraint(plan.constraint, "tools", limits.caps)
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
            ids, mm_inputs = expand(ids, images, image_support(self.state.config.model_path).pad_id)  # type: ignore[union-attr]
        if tooling:
            constraint = chat_parsing.request_constraint(plan, constraint, config, text)
        spec = build_spec(req, ids, limits, external_id=external, stream=req.stream, structured_outputs=constraint)
        spec.mm_inputs = mm_inputs
        texts = self.token_texts(renderer, bool(req.logprobs))
        fmt: ChatFormatter
        if parsed:
            fmt = chat_parsing.ParsedChatFormatter(
                f"chatcmpl-{external}", int(time.time()), self.state.model_name, req.n, texts, req.return_token_ids,
                tools=plan, reasoning=config.reasoning_parser, prompt=text)
        else:
            fmt = ChatFormatter(f"chatcmpl-{external}", int(time.time()), self.state.model_name, req.n, texts,
                                req.return_token_ids)
        opts = req.stream_options
        await respond(llm, [spec], fmt, send, stream=req.stream,
                      include_usage=bool(opts and opts.include_usage),
                      continuous_usage=bool(opts and opts.include_usage and opts.continuous_usage_stats),
                      keepalive=self.state.config.sse_keepalive, headers=[(b"x-request-id", external.encode())])
