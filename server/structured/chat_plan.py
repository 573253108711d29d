"""What every route over the chat path (OpenAI chat, Anthropic messages, Ollama chat, Responses) settles about a
chat request's output before admitting it: its constraint (response_format / structured_outputs), its tool plan with
the tool parameters the grammar relaxes, and from them the engine's one constraint, the choice parsers, the check of
relaxed answers and its header; then `respond_checked`, the answer (chat and completions) with relaxed answers
checked before the end."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from engine.messages import ImageInput, StructuredOutputs
from server.config import ServerConfig
from server.http.asgi import Send
from server.request.admission import AdmissionTicket
from server.request.async_llm import AsyncLLM
from server.request.formatter import OPENAI_FRAMING, Formatter, StreamFraming
from server.request.input_processor import GenerationSpec, ModelLimits, build_spec, check_request
from server.request.openai_protocol import ChatCompletionRequest, CompletionRequest
from server.request.respond import BeforeEnd, Headers, respond
from server.structured.constraint import Constraint, Relaxation, structured_outputs
from server.structured.output_check import CheckedFormatter, CheckMetrics, OutputCheck, relaxed_check, relaxed_headers
from server.structured.parsing import ChoiceParser, ChoiceParsers, plan_constrained_tools, request_constraint
from server.tools.choice import ToolPlan


@dataclass(frozen=True)
class ChatPlan:
    config: ServerConfig
    constraint: Constraint | None
    tools: ToolPlan | None
    relaxed_tools: dict[str, Relaxation]

    @property
    def parsed(self) -> bool:
        """Whether a tool call parser or a reasoning parser reads the output."""
        tools = self.tools is not None and self.tools.parser is not None
        return tools or self.config.outputs.reasoning_parser is not None

    def without_format(self) -> ChatPlan:
        """The plan with response_format's constraint dropped (a forced tool call writes no text)."""
        return dataclasses.replace(self, constraint=None)

    def spec(
        self,
        chat: ChatCompletionRequest,
        ids: list[int],
        limits: ModelLimits,
        external: str,
        prompt: str,
        mm_inputs: list[ImageInput] | None,
    ) -> GenerationSpec:
        """The engine request for the rendered `prompt` (`ids`), with the one constraint the engine enforces."""
        given = self.constraint.so if self.constraint is not None else None
        so: StructuredOutputs | None = request_constraint(self.tools, given, self.config, prompt)
        spec = build_spec(chat, ids, limits, external_id=external, stream=chat.stream, structured_outputs=so)
        spec.mm_inputs = mm_inputs
        return spec

    def parsers(self, prompt: str) -> ChoiceParsers | None:
        return ChoiceParsers(self.tools, self.config.outputs.reasoning_parser, prompt) if self.parsed else None

    def parser(self, prompt: str) -> ChoiceParser | None:
        """One choice's parser for an answer to `prompt` (None: nothing parses the output)."""
        parsers = self.parsers(prompt)
        return parsers.new() if parsers is not None else None

    def check(self, metrics: CheckMetrics | None, prompt: str) -> OutputCheck | None:
        return relaxed_check(metrics, self.constraint, self.relaxed_tools, self.parsers(prompt))

    def headers(self) -> list[tuple[bytes, bytes]]:
        return relaxed_headers(self.constraint, self.relaxed_tools)


async def plan_chat(
    chat: ChatCompletionRequest, config: ServerConfig, tokenizer: Any, limits: ModelLimits, tool_param: str
) -> ChatPlan:
    """The request's checks that need no tokens, then its plan; every problem a 400 (a bad tool choice's naming
    `tool_param`)."""
    check_request(chat, limits)
    constraint = await structured_outputs(chat, limits.caps, tokenizer=tokenizer)
    tools, relaxed = await plan_constrained_tools(chat, config, tokenizer, limits.caps, tool_param)
    return ChatPlan(config, constraint, tools, relaxed)


def _checked(fmt: Formatter, check: OutputCheck | None) -> Formatter:
    return fmt if check is None else CheckedFormatter(fmt, check)


async def respond_checked(
    llm: AsyncLLM,
    specs: list[GenerationSpec],
    fmt: Formatter,
    check: OutputCheck | None,
    send: Send,
    req: ChatCompletionRequest | CompletionRequest,
    headers: Headers,
    ticket: AdmissionTicket,
    *,
    keepalive: float = 0.0,
    framing: StreamFraming = OPENAI_FRAMING,
    before_end: BeforeEnd = None,
) -> None:
    """`respond` for a chat or completions request (usage as its `stream_options` asks) with the relaxed answers
    checked before the end (a `before_end` given awaits the check itself)."""
    options = req.stream_options
    usage = bool(options and options.include_usage)
    await respond(
        llm,
        specs,
        _checked(fmt, check),
        send,
        stream=req.stream,
        include_usage=usage,
        continuous_usage=usage and bool(options and options.continuous_usage_stats),
        keepalive=keepalive,
        headers=headers,
        framing=framing,
        before_end=before_end if before_end is not None or check is None else check.finish,
        ticket=ticket,
    )
