"""POST /v1/chat/completions."""

from __future__ import annotations

import time

from server.families.openai.formatter import ChatFormatter, ParsedChatFormatter
from server.http.asgi import Send
from server.reasoning.token_count import decoder
from server.request.input_processor import build_spec, check_request, external_request_id
from server.request.openai_protocol import chat_decoder
from server.request.post_route import PostRoute
from server.request.prompt_tokens import chat_prompt, fit_limits, require_messages
from server.structured.constraint import Relaxation, structured_outputs
from server.structured.output_check import relaxed_check, relaxed_headers, respond_openai
from server.structured.parsing import ChoiceParsers, plan_constrained_tools, request_constraint


class ChatRoute(PostRoute):
    runner = "generate"

    async def _work(self, body: bytes, xid: str | None, send: Send) -> None:
        req, llm, renderer, limits = self.state.decode_for_model(chat_decoder, body)
        require_messages(req)
        check_request(req, limits)
        constraint = await structured_outputs(req, limits.caps, tokenizer=renderer.tokenizer)
        config = self.state.config
        tooling = req.tools is not None or req.tool_choice is not None or config.outputs.reasoning_parser is not None
        plan, parsed, relaxed_tools = None, False, dict[str, Relaxation]()
        if tooling:
            plan, relaxed_tools = await plan_constrained_tools(req, config, renderer.tokenizer, limits.caps, "tools")
            parsed = (plan is not None and plan.parser is not None) or config.outputs.reasoning_parser is not None
        external = external_request_id(xid, req.request_id)
        with llm.admit(req.n, req.n) as ticket:  # the request's one ticket: a 503 now when the queue is surely full
            text, ids, mm_inputs = await chat_prompt(self.state, llm, renderer, req, ticket, fit_limits(req, limits))
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
                    f"chatcmpl-{external}",
                    int(time.time()),
                    shown,
                    req.n,
                    texts,
                    req.return_token_ids,
                    tools=plan,
                    reasoning=config.outputs.reasoning_parser,
                    prompt=text,
                    decode=decoder(renderer.tokenizer, spec.skip_special_tokens)
                    if config.outputs.reasoning_parser
                    else None,
                )
            else:
                fmt = ChatFormatter(f"chatcmpl-{external}", int(time.time()), shown, req.n, texts, req.return_token_ids)
            check = relaxed_check(
                llm.metrics,
                constraint,
                relaxed_tools,
                ChoiceParsers(plan, config.outputs.reasoning_parser, text) if parsed else None,
            )
            headers = [(b"x-request-id", external.encode()), *relaxed_headers(constraint, relaxed_tools)]
            keepalive = self.state.config.outputs.sse_keepalive
            await respond_openai(llm, [spec], fmt, check, send, req, keepalive, headers, ticket)
