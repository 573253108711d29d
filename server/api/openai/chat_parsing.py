"""Chat answers read by a tool-call parser and/or a reasoning parser: the request's plan (tool_choice ->
parser + constraint; where the reasoning starts), and the formatter that assembles `message.tool_calls`,
`message.reasoning` and the streamed deltas. One parser per choice, fed the same text streamed or not,
so a client assembling the stream gets exactly the non-streamed message.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from engine.messages import StructuredOutputs
from server.api.openai.chat import ChatFormatter
from server.api.openai.logprobs import TokenTexts, chat_logprobs
from server.config import ServerConfig
from server.http.errors import APIError
from server.pipeline.output_processor import Output
from server.protocol.openai import (
    ChatChoice, ChatChoiceIds, ChatCompletionRequest, ChatCompletionResponse, ChatMessage, ChatMessageReasoning,
    ChatStreamChoice, ChatStreamChoiceIds, DeltaMessage, Usage, encoder,
)
from server.reasoning.parser import ReasoningParser, get_reasoning_parser, prompt_in_reasoning
from server.tools.choice import ToolPlan, plan_tools
from server.tools.parser import ToolCallDelta, ToolParser, assemble

_enc = encoder.encode
REASONING_END = "</think>"


def added_token_ids(tokenizer: Any) -> Callable[[str], int | None]:
    """text -> id of the tokenizer's added token spelled so (None: not one added token)."""
    try:
        table = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items()}
    except AttributeError:
        table = {}
    return table.get


def plan_request_tools(req: ChatCompletionRequest, config: ServerConfig, tokenizer: Any) -> ToolPlan | None:
    """The request's tool plan (a 400 for a bad tool_choice); mistral's parser needs special tokens kept."""
    plan = plan_tools(req.tools, req.tool_choice, parser_name=config.tool_call_parser,
                      enable_auto=config.enable_auto_tool_choice, token_id=added_token_ids(tokenizer),
                      parallel=req.parallel_tool_calls is not False)
    if plan is not None and not plan.skip_special_tokens:
        req.skip_special_tokens = False
    return plan


def request_constraint(plan: ToolPlan | None, constraint: StructuredOutputs | None, config: ServerConfig,
                       prompt: str) -> StructuredOutputs | None:
    """The one constraint sent to the engine: response_format's / structured_outputs' or the tool choice's;
    with a reasoning parser it starts after `</think>` unless the prompt already closed the reasoning."""
    if plan is not None and plan.constraint is not None:
        if constraint is not None:
            raise APIError(f'tool_choice "{plan.mode}" cannot be combined with response_format or '
                           "structured_outputs: both constrain the output", status=400, param="tool_choice")
        constraint = plan.constraint
    if constraint is not None and config.reasoning_parser is not None and prompt_in_reasoning(prompt) is not False:
        constraint = msgspec.structs.replace(constraint, reasoning_end=REASONING_END)
    return constraint


def reasoning_parser(config: ServerConfig, prompt: str) -> ReasoningParser | None:
    """A fresh reasoning parser for one answer to `prompt` (None: the server has none)."""
    if config.reasoning_parser is None:
        return None
    return get_reasoning_parser(config.reasoning_parser)(prompt_in_reasoning(prompt))


@dataclass
class ChoiceDelta:
    reasoning: str
    content: str
    calls: list[ToolCallDelta]


class ChoiceParser:
    """One choice's text through the reasoning parser, then the tool parser."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.called = False

    def feed(self, text: str, final: bool) -> ChoiceDelta:
        reasoning = ""
        if self.reasoning is not None:
            r = self.reasoning.feed(text, final)
            reasoning, text = r.reasoning, r.content
        calls: list[ToolCallDelta] = []
        if self.tools is not None:
            t = self.tools.feed(text, final)
            text, calls = t.content, t.calls
            self.called = self.called or bool(calls)
        return ChoiceDelta(reasoning, text, calls)

    def finish_reason(self, finish: str | None) -> str | None:
        return "tool_calls" if finish == "stop" and self.called else finish


def _call_json(d: ToolCallDelta) -> dict[str, Any]:
    function: dict[str, Any] = {"arguments": d.arguments}
    if d.name is not None:
        function["name"] = d.name
    out: dict[str, Any] = {"index": d.index}
    if d.id is not None:
        out["id"] = d.id
        out["type"] = "function"
    out["function"] = function
    return out


class ParsedChatFormatter(ChatFormatter):
    """ChatFormatter for answers read by parsers. Stateful per choice, so the route formats each output
    exactly once (`direct_ok`: no direct write from the output handler, whose declined outputs the route
    would format again)."""

    direct_ok = False

    def __init__(self, request_id: str, created: int, model: str, n: int, texts: TokenTexts | None,
                 token_ids: bool, *, tools: ToolPlan | None, reasoning: str | None, prompt: str) -> None:
        super().__init__(request_id, created, model, n, texts, token_ids)
        self._plain = False
        self._tool_parser = tools.parser if tools is not None else None
        self._reasoning_cls = get_reasoning_parser(reasoning) if reasoning is not None else None
        self._prompt_state = prompt_in_reasoning(prompt) if reasoning is not None else None
        self._choices: dict[int, ChoiceParser] = {}

    def _parser(self) -> ChoiceParser:
        r = self._reasoning_cls(self._prompt_state) if self._reasoning_cls is not None else None
        return ChoiceParser(r, self._tool_parser() if self._tool_parser is not None else None)

    def stream_chunk(self, batch: list[Output], usage: Usage | None) -> bytes | None:
        parts = []
        for out in batch:
            parser = self._choices.get(out.index)
            if parser is None:
                parser = self._choices[out.index] = self._parser()
            d = parser.feed(out.text, out.finish_reason is not None)
            finish = parser.finish_reason(out.finish_reason)
            if not (d.reasoning or d.content or d.calls or finish or out.logprobs or self.token_ids):
                continue  # held back (a tag may be starting): nothing to say yet
            delta = DeltaMessage(content=d.content or None, reasoning=d.reasoning or None,
                                 reasoning_content=d.reasoning or None,
                                 tool_calls=[_call_json(c) for c in d.calls] or None)
            lp = chat_logprobs(out.logprobs or [], self.texts) if self.texts is not None else None
            if self.token_ids:
                parts.append(_enc(ChatStreamChoiceIds(out.index, delta, lp, finish, out.stop_reason, out.token_ids)))
            else:
                parts.append(_enc(ChatStreamChoice(out.index, delta, lp, finish, out.stop_reason)))
        if not parts and usage is None:
            return None
        tail = b"]}\n\n" if usage is None else b'],"usage":' + _enc(usage) + b"}\n\n"
        return self._prefix + b",".join(parts) + tail

    def final(self, outputs: list[Output], usage: Usage) -> bytes:
        choices: list[ChatChoice] = []
        for o in outputs:
            parser = self._parser()
            d = parser.feed(o.text, True)
            calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                     for c in assemble(d.calls)]
            message: ChatMessage
            if self._reasoning_cls is not None:
                message = ChatMessageReasoning("assistant", d.content or None, calls, reasoning=d.reasoning or None,
                                               reasoning_content=d.reasoning or None)
            else:
                message = ChatMessage("assistant", d.content or (None if calls else ""), calls)
            lp = chat_logprobs(o.logprobs or [], self.texts) if self.texts is not None else None
            finish = parser.finish_reason(o.finish_reason)
            if self.token_ids:
                choices.append(ChatChoiceIds(o.index, message, lp, finish, o.stop_reason, o.token_ids))
            else:
                choices.append(ChatChoice(o.index, message, lp, finish, o.stop_reason))
        return _enc(ChatCompletionResponse(self.id, self.created, self.model, choices, usage))
