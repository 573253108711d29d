"""An Anthropic Messages request -> the chat path's ChatCompletionRequest (messages and tools in the shape chat
templates take), and the pipeline's finish -> Anthropic's stop_reason.

Everything a field asks for is either honoured or refused with a 400 naming it; nothing semantic is dropped.
"""

from __future__ import annotations

from typing import Any

import msgspec

from server.families.anthropic.protocol import (
    CountTokensRequest,
    ImageBlock,
    InputMessage,
    MessagesRequest,
    TextBlock,
    ThinkingBlock,
    Tool,
    ToolChoice,
    ToolResultBlock,
    ToolUseBlock,
)
from server.http.errors import APIError, bad_request, from_decode_error
from server.request.openai_protocol import ChatCompletionRequest, JSONSchemaFormat, ResponseFormat

NO_IMAGES = "images are not supported yet: this server serves a text-only model; send text content"
_ERROR_PREFIX = "Error: "  # a failed tool result is marked in its text: templates have no is_error field


def decode_error(error: msgspec.DecodeError) -> APIError:
    """The shared 400 for a malformed body, pointing at Anthropic's reference rather than OpenAI's."""
    e = from_decode_error(error)
    e.message = e.message.replace("the OpenAI API reference", "the Anthropic Messages API reference")
    return e


def _texts(blocks: list[TextBlock | ImageBlock], param: str) -> str:
    parts = []
    for j, block in enumerate(blocks):
        if isinstance(block, ImageBlock):
            raise bad_request(f"{param}[{j}]: {NO_IMAGES}.", f"{param}[{j}]")
        parts.append(block.text)
    return "\n".join(parts)  # as the OpenAI route joins text parts (server/render/renderer.py)


def system_text(system: str | list[TextBlock] | None) -> str | None:
    if system is None or isinstance(system, str):
        return system
    return "\n".join(block.text for block in system)


def _tool_result(block: ToolResultBlock, names: dict[str, str], param: str) -> dict[str, Any]:
    content = block.content
    text = "" if content is None else content if isinstance(content, str) else _texts(content, f"{param}.content")
    if block.is_error:
        text = _ERROR_PREFIX + text
    message: dict[str, Any] = {"role": "tool", "tool_call_id": block.tool_use_id, "content": text}
    if block.tool_use_id in names:  # some templates print the tool's name with its result
        message["name"] = names[block.tool_use_id]
    return message


def image_part(block: ImageBlock, param: str) -> dict[str, Any]:
    """An Anthropic image block -> the OpenAI route's image_url part (base64 -> a data: URL; url as is, where
    --allowed-media-domains decides)."""
    source = block.source or {}
    kind = source.get("type")
    if kind == "base64":
        media, data = source.get("media_type"), source.get("data")
        if not isinstance(media, str) or not media.startswith("image/") or not isinstance(data, str):
            raise bad_request(
                f'{param}: a base64 image source needs "media_type": "image/..." and "data"', f"{param}.source"
            )
        return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}
    if kind == "url" and isinstance(source.get("url"), str):
        return {"type": "image_url", "image_url": {"url": source["url"]}}
    raise bad_request(
        f'{param}: an image source must be {{"type": "base64", ...}} or {{"type": "url", ...}}', f"{param}.source"
    )


def _user(i: int, message: InputMessage, names: dict[str, str], images: bool) -> list[dict[str, Any]]:
    """One user turn -> tool messages for its tool_result blocks and user messages for its text (and, on a vision
    model, image parts), in order."""
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []

    def flush() -> None:
        texts = [p["text"] for p in parts if p["type"] == "text"]
        if len(texts) == len(parts):
            out.append({"role": "user", "content": "\n".join(texts)})
        else:
            out.append({"role": "user", "content": list(parts)})
        parts.clear()

    for j, block in enumerate(message.content):
        param = f"messages[{i}].content[{j}]"
        if isinstance(block, TextBlock):
            parts.append({"type": "text", "text": block.text})
        elif isinstance(block, ToolResultBlock):
            if parts:
                flush()
            out.append(_tool_result(block, names, param))
        elif isinstance(block, ImageBlock):
            if not images:
                raise bad_request(f"{param}: {NO_IMAGES}.", param)
            parts.append(image_part(block, param))
        else:
            kind = "tool_use" if isinstance(block, ToolUseBlock) else "thinking"
            raise bad_request(f"{param}: a {kind} block may only appear in an assistant message.", param)
    if parts or not out:
        flush()
    return out


def _assistant(i: int, message: InputMessage, names: dict[str, str]) -> dict[str, Any]:
    """One assistant turn -> one message: text, tool_calls (arguments as objects, as templates expect) and
    reasoning_content from thinking blocks."""
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    thinking: list[str] = []
    for j, block in enumerate(message.content):
        param = f"messages[{i}].content[{j}]"
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlock):
            names[block.id] = block.name
            calls.append(
                {"id": block.id, "type": "function", "function": {"name": block.name, "arguments": block.input}}
            )
        elif isinstance(block, ThinkingBlock):
            thinking.append(block.thinking)
        elif isinstance(block, ImageBlock):
            raise bad_request(f"{param}: {NO_IMAGES}.", param)
        else:
            raise bad_request(f"{param}: a tool_result block may only appear in a user message.", param)
    out: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}  # "" rather than none: templates
    if calls:  # concatenate content
        out["tool_calls"] = calls
    if thinking:
        out["reasoning_content"] = "\n".join(thinking)
    return out


def chat_messages(req: CountTokensRequest, images: bool = False) -> list[dict[str, Any]]:
    """Anthropic's system + messages -> the chat template's messages (system, user, assistant, tool).

    `images`: the model takes images (user image blocks become image_url parts); else they are a 400."""
    if not req.messages:
        raise bad_request("messages must hold at least one message.", "messages")
    out: list[dict[str, Any]] = []
    system = system_text(req.system)
    if system is not None:
        out.append({"role": "system", "content": system})
    names: dict[str, str] = {}  # tool_use id -> tool name, for the tool messages that answer it
    for i, message in enumerate(req.messages):
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
        elif message.role == "user":
            out.extend(_user(i, message, names, images))
        else:
            out.append(_assistant(i, message, names))
    check_tool_pairing(req.messages)  # after each block's own checks
    return out


def _ids(message: InputMessage, kind: type[ToolUseBlock] | type[ToolResultBlock]) -> list[str]:
    if isinstance(message.content, str):
        return []
    return [b.id if isinstance(b, ToolUseBlock) else b.tool_use_id for b in message.content if isinstance(b, kind)]


def check_tool_pairing(messages: list[InputMessage]) -> None:
    """Anthropic's rule: every tool_use in an assistant turn is answered by a tool_result in the next (user) turn,
    and a tool_result answers a tool_use of the turn just before it; else a 400 with Anthropic's wording. A
    final assistant turn (a prefill) has no next turn to answer it yet."""
    for i, message in enumerate(messages):
        if message.role == "user":
            before = (
                set(_ids(messages[i - 1], ToolUseBlock)) if i > 0 and messages[i - 1].role == "assistant" else set()
            )
            for j, block in enumerate(message.content if not isinstance(message.content, str) else []):
                if isinstance(block, ToolResultBlock) and block.tool_use_id not in before:
                    raise bad_request(
                        f"messages.{i}.content.{j}: unexpected `tool_use_id` found in `tool_result` "
                        f"blocks: {block.tool_use_id}. Each `tool_result` block must have a "
                        "corresponding `tool_use` block in the previous message.",
                        f"messages[{i}].content[{j}]",
                    )
        uses = _ids(message, ToolUseBlock) if message.role == "assistant" else []
        if uses and i + 1 < len(messages):
            answered = set(_ids(messages[i + 1], ToolResultBlock)) if messages[i + 1].role == "user" else set()
            missing = [u for u in uses if u not in answered]
            if missing:
                raise bad_request(
                    f"messages.{i}: `tool_use` ids were found without `tool_result` blocks "
                    f"immediately after: {', '.join(missing)}. Each `tool_use` block must have a "
                    "corresponding `tool_result` block in the next message.",
                    f"messages[{i}]",
                )


def _tool(i: int, tool: Tool) -> dict[str, Any]:
    if tool.type not in (None, "custom"):
        raise bad_request(
            f"tools[{i}]: server tools ({tool.type!r}) are not supported; define a custom tool with "
            "name, description and input_schema.",
            f"tools[{i}]",
        )
    if tool.input_schema is None:
        raise bad_request(f"tools[{i}].input_schema is required.", f"tools[{i}].input_schema")
    function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        function["description"] = tool.description
    if tool.strict:
        function["strict"] = True
    return {"type": "function", "function": function}


def chat_tool_choice(choice: ToolChoice | None) -> tuple[str | dict[str, Any] | None, bool | None]:
    """Anthropic's tool_choice -> (OpenAI's tool_choice, parallel_tool_calls). "auto" is the server's default
    (parsed with --enable-auto-tool-choice, else the tools are only rendered); "any" is "required"."""
    if choice is None:
        return None, None
    parallel = False if choice.disable_parallel_tool_use else None
    if choice.type == "tool":
        if not choice.name:
            raise bad_request('tool_choice of type "tool" needs the tool\'s name.', "tool_choice.name")
        return {"type": "function", "function": {"name": choice.name}}, parallel
    return {"auto": None, "any": "required", "none": "none"}[choice.type], parallel


def thinking_kwargs(req: CountTokensRequest, reasoning: bool) -> dict[str, Any] | None:
    """`thinking` -> the template's enable_thinking (Qwen3's templates read it; others ignore it). Enabled
    thinking needs a reasoning parser to split it out; budget_tokens is checked, not enforced."""
    thinking = req.thinking
    if thinking is None:
        return None
    if thinking.type == "disabled":
        return {"enable_thinking": False}
    if thinking.type not in ("enabled", "adaptive"):
        raise bad_request(
            f'thinking.type must be "enabled", "adaptive" or "disabled", not {thinking.type!r}.', "thinking.type"
        )
    if not reasoning:
        raise bad_request(
            "thinking needs a reasoning model: start the server with --reasoning-parser, or leave "
            'thinking out or set its type to "disabled".',
            "thinking",
        )
    budget = thinking.budget_tokens
    if thinking.type == "enabled" and (budget is None or budget < 1024):
        raise bad_request("thinking.budget_tokens must be at least 1024.", "thinking.budget_tokens")
    if isinstance(req, MessagesRequest) and budget is not None and budget >= req.max_tokens:
        raise bad_request("max_tokens must be greater than thinking.budget_tokens.", "max_tokens")
    return {"enable_thinking": True}


def response_format(req: CountTokensRequest) -> ResponseFormat | None:
    """output_config.format {"type": "json_schema", "schema": ...} -> OpenAI's response_format json_schema."""
    fmt = req.output_config.format if req.output_config is not None else None
    if fmt is None:
        return None
    if fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise bad_request(
            'output_config.format must be {"type": "json_schema", "schema": {...}}.', "output_config.format"
        )
    # strict: Anthropic's structured outputs always conform to the schema, and refuse what they cannot enforce
    return ResponseFormat(
        type="json_schema", json_schema=JSONSchemaFormat(name="output", schema=fmt["schema"], strict=True)
    )


def chat_tools(req: CountTokensRequest) -> list[dict[str, Any]] | None:
    """Tools in OpenAI's function shape, which chat templates take."""
    return [_tool(i, t) for i, t in enumerate(req.tools)] if req.tools else None


def chat_request(req: CountTokensRequest, *, reasoning: bool = False, images: bool = False) -> ChatCompletionRequest:
    """The chat request the chat path renders, checks and builds the engine request from.

    A final assistant message is a prefill: the answer continues it, as Anthropic's API does.
    `reasoning`: the server has a reasoning parser (thinking can be turned on); `images`: the model takes images.
    """
    messages = chat_messages(req, images)
    prefill = req.messages[-1].role == "assistant"
    tool_choice, parallel = chat_tool_choice(req.tool_choice)
    chat = ChatCompletionRequest(
        model=req.model,
        messages=messages,
        tools=chat_tools(req),
        add_generation_prompt=not prefill,
        continue_final_message=prefill,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel,
        chat_template_kwargs=thinking_kwargs(req, reasoning),
        response_format=response_format(req),
    )
    if isinstance(req, MessagesRequest):
        chat.max_tokens = req.max_tokens
        chat.stop = req.stop_sequences
        chat.temperature, chat.top_p, chat.top_k = req.temperature, req.top_p, req.top_k
        chat.stream = req.stream
    return chat


def stop_reason(finish_reason: str | None, matched: int | str | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence): the pipeline's Output carries the matched stop string as its stop_reason
    (a stop token id is an int: a natural end). "tool_calls" comes from the tool parser's finish."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "stop" and isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None
