"""POST /v1/chat/completions."""

from __future__ import annotations

import time

from server.families.openai.formatter import ChatFormatter, ParsedChatFormatter
from server.http.asgi import Send
from server.reasoning.token_count import decoder
from server.request.input_processor import external_request_id
from server.request.openai_protocol import chat_decoder
from server.request.post_route import PostRoute
from server.request.prompt_tokens import chat_prompt, fit_limits, require_messages
from server.structured.chat_plan import plan_chat, respond_checked


class ChatRoute(PostRoute):
    runner = "generate"

    async def _work(self, body: bytes, xid: str | None, send: Send) -> None:
        req, llm, renderer, limits = self.state.decode_for_model(chat_decoder, body)
        require_messages(req)
        config = self.state.config
        plan = await plan_chat(req, config, renderer.tokenizer, limits, "tools")
        external = external_request_id(xid, req.request_id)
        with llm.admit(req.n, req.n) as ticket:  # the request's one ticket: a 503 now when the queue is surely full
            text, ids, mm_inputs = await chat_prompt(self.state, llm, renderer, req, ticket, fit_limits(req, limits))
            spec = plan.spec(req, ids, limits, external, text, mm_inputs)
            texts = self.token_texts(renderer, bool(req.logprobs))
            fmt: ChatFormatter
            shown = self.state.shown_model(req.model)
            if plan.parsed:
                fmt = ParsedChatFormatter(
                    f"chatcmpl-{external}",
                    int(time.time()),
                    shown,
                    req.n,
                    texts,
                    req.return_token_ids,
                    tools=plan.tools,
                    reasoning=config.outputs.reasoning_parser,
                    prompt=text,
                    decode=decoder(renderer.tokenizer, spec.skip_special_tokens)
                    if config.outputs.reasoning_parser
                    else None,
                )
            else:
                fmt = ChatFormatter(f"chatcmpl-{external}", int(time.time()), shown, req.n, texts, req.return_token_ids)
            check = plan.check(llm.metrics, text)
            headers = [(b"x-request-id", external.encode()), *plan.headers()]
            keepalive = self.state.config.outputs.sse_keepalive
            await respond_checked(llm, [spec], fmt, check, send, req, headers, ticket, keepalive=keepalive)
