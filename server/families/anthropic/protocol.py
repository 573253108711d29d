"""msgspec Structs for Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) and its error shape.

Unknown request fields are ignored, as in the OpenAI structs; content blocks are a tagged union on `type`, so a
block type this server does not know is a 400 naming where it is.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from server.request.openai_protocol import Int64

# ----------------------------------------------------------------------------------------- requests


class TextBlock(msgspec.Struct, tag_field="type", tag="text", kw_only=True):
    text: str


class ImageBlock(msgspec.Struct, tag_field="type", tag="image", kw_only=True):
    source: dict[str, Any] | None = None  # decoded only to refuse it with a clear message


class ToolUseBlock(msgspec.Struct, tag_field="type", tag="tool_use", kw_only=True):
    id: str
    name: str
    input: dict[str, Any] = msgspec.field(default_factory=dict)


class ToolResultBlock(msgspec.Struct, tag_field="type", tag="tool_result", kw_only=True):
    tool_use_id: str
    content: str | list[TextBlock | ImageBlock] | None = None
    is_error: bool = False


class ThinkingBlock(msgspec.Struct, tag_field="type", tag="thinking", kw_only=True):
    thinking: str
    signature: str | None = None


ContentBlock = TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock


class InputMessage(msgspec.Struct, kw_only=True):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None  # required for custom tools; server tools (a `type`) have none
    type: str | None = None
    strict: bool | None = None  # true: input_schema enforced whole or refused; else best effort


class ToolChoice(msgspec.Struct, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(msgspec.Struct, kw_only=True):
    type: str
    budget_tokens: Int64 | None = None


class OutputConfig(msgspec.Struct, kw_only=True):
    format: dict[str, Any] | None = None  # structured outputs: {"type": "json_schema", "schema": {...}}
    effort: str | None = None  # a hint for how hard to think: no knob here, accepted


class CountTokensRequest(msgspec.Struct, kw_only=True):
    """What shapes the prompt: the fields /v1/messages/count_tokens takes."""

    model: str | None = None
    messages: list[InputMessage]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None


class MessagesRequest(CountTokensRequest, kw_only=True):
    max_tokens: Int64
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None  # informational (user_id): accepted, not used


# ---------------------------------------------------------------------------------------- responses


class TextContent(msgspec.Struct, tag_field="type", tag="text"):
    text: str


class ToolUseContent(msgspec.Struct, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]


class ThinkingContent(msgspec.Struct, tag_field="type", tag="thinking"):
    thinking: str
    signature: str = ""  # Anthropic signs its thinking for replay; a local model's has nothing to sign


class MessageUsage(msgspec.Struct):
    input_tokens: int
    output_tokens: int


class MessageResponse(msgspec.Struct, tag_field="type", tag="message", kw_only=True):
    id: str
    role: str = "assistant"
    model: str
    content: list[ThinkingContent | TextContent | ToolUseContent]
    stop_reason: str | None
    stop_sequence: str | None
    usage: MessageUsage


class CountTokensResponse(msgspec.Struct):
    input_tokens: int


# Errors: the body is built in server/http/errors.py (`anthropic_error_body`): the transport's 401 has it too.

encoder = msgspec.json.Encoder()
messages_decoder = msgspec.json.Decoder(MessagesRequest)
count_tokens_decoder = msgspec.json.Decoder(CountTokensRequest)
