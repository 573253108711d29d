"""Chat answers read by a tool-call parser and/or a reasoning parser, whatever the wire format (the OpenAI
chat route and the Anthropic messages route both use this): the request's plan (tool_choice -> parser +
constraint; where the reasoning starts) and one `ChoiceParser` per choice, fed the same text streamed or not,
so a client assembling the stream gets exactly the non-streamed answer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from engine.messages import StructuredOutputs
from server.config import RequestCaps, ServerConfig
from server.http.errors import APIError
from server.reasoning.parser import ReasoningParser, get_reasoning_parser, prompt_in_reasoning
from server.request.openai_protocol import ChatCompletionRequest
from server.structured.constraint import Relaxation, check_constraint
from server.structured.tool_schemas import relax_tools
from server.tools.choice import ToolPlan, plan_tools
from server.tools.parser import ToolCallDelta, ToolParser

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
    plan = plan_tools(
        req.tools,
        req.tool_choice,
        parser_name=config.outputs.tool_call_parser,
        enable_auto=config.outputs.enable_auto_tool_choice,
        token_id=added_token_ids(tokenizer),
        parallel=req.parallel_tool_calls is not False,
    )
    if plan is not None and not plan.skip_special_tokens:
        req.skip_special_tokens = False
    return plan


async def plan_constrained_tools(
    req: ChatCompletionRequest, config: ServerConfig, tokenizer: Any, caps: RequestCaps, param: str
) -> tuple[ToolPlan | None, dict[str, Relaxation]]:
    """The tool plan with its constraint validated (a 400 naming `param`); when the tool choice constrains the
    output, non-strict functions' parameters are relaxed first (server/structured/tool_schemas.py) and what each
    left out is returned by function name."""
    plan = plan_request_tools(req, config, tokenizer)
    if plan is None or plan.constraint is None or not req.tools:
        return plan, {}
    tools, relaxed = await relax_tools(req.tools, caps)
    if relaxed:  # rendered with the tools as given; constrained by their relaxed parameters
        plan = plan_request_tools(msgspec.structs.replace(req, tools=tools), config, tokenizer)
    assert plan is not None and plan.constraint is not None
    await check_constraint(plan.constraint, param, caps)
    return plan, relaxed


def request_constraint(
    plan: ToolPlan | None, constraint: StructuredOutputs | None, config: ServerConfig, prompt: str
) -> StructuredOutputs | None:
    """The one constraint sent to the engine: response_format's / structured_outputs' or the tool choice's;
    with a reasoning parser it starts after `</think>` unless the prompt already closed the reasoning."""
    if plan is not None and plan.constraint is not None:
        if constraint is not None:
            raise APIError(
                f'tool_choice "{plan.mode}" cannot be combined with response_format or '
                "structured_outputs: both constrain the output",
                status=400,
                param="tool_choice",
            )
        constraint = plan.constraint
    if (
        constraint is not None
        and config.outputs.reasoning_parser is not None
        and prompt_in_reasoning(prompt) is not False
    ):
        constraint = msgspec.structs.replace(constraint, reasoning_end=REASONING_END)
    return constraint


def reasoning_parser(config: ServerConfig, prompt: str) -> ReasoningParser | None:
    """A fresh reasoning parser for one answer to `prompt` (None: the server has none)."""
    if config.outputs.reasoning_parser is None:
        return None
    return get_reasoning_parser(config.outputs.reasoning_parser)(prompt_in_reasoning(prompt))


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


class ChoiceParsers:
    """A fresh ChoiceParser per choice, from a request's tool plan and the server's reasoning parser."""

    def __init__(self, tools: ToolPlan | None, reasoning: str | None, prompt: str) -> None:
        self._tool_parser = tools.parser if tools is not None else None
        self.reasoning_cls = get_reasoning_parser(reasoning) if reasoning is not None else None
        self._prompt_state = prompt_in_reasoning(prompt) if reasoning is not None else None

    def new(self) -> ChoiceParser:
        r = self.reasoning_cls(self._prompt_state) if self.reasoning_cls is not None else None
        return ChoiceParser(r, self._tool_parser() if self._tool_parser is not None else None)
