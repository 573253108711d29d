"""msgspec Structs for OpenAI's Responses API (POST /v1/responses). `input` items stay plain dicts: their
translation (server/families/responses/items.py) checks each and names the field on a 400."""

from __future__ import annotations

from typing import Any

import msgspec

from server.request.openai_protocol import Int64


class TextConfig(msgspec.Struct, kw_only=True):
    format: dict[str, Any] | None = None  # {"type": "text" | "json_object" | "json_schema", ...}
    verbosity: str | None = None  # a hint: no knob here, accepted


class ReasoningConfig(msgspec.Struct, kw_only=True):
    effort: str | None = None  # a hint: no knob here, accepted
    summary: str | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """POST /v1/responses. None means 'not given'."""

    model: str | None = None
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    max_output_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None  # vLLM's extra
    seed: Int64 | None = None
    stop: str | list[str] | None = None  # vLLM's extra (OpenAI's Responses API has none)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    include: list[str] | None = None
    top_logprobs: Int64 | None = None
    truncation: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool = True  # OpenAI's default
    previous_response_id: str | None = None
    conversation: Any = None  # refused when set (server/families/responses/items.py): no conversations API here
    prompt: Any = None  # refused when set: no stored prompt templates here
    stream: bool = False
    background: bool = False


responses_decoder = msgspec.json.Decoder(ResponsesRequest)
encoder = msgspec.json.Encoder()
