"""Ollama requests -> the OpenAI structs the shared path takes: `options` onto sampling fields, `format` onto
response_format, messages (images, tool calls with object arguments, thinking) into the chat template's shape."""

from __future__ import annotations

from typing import Any

import msgspec

from server.families.ollama.protocol import ChatRequest, GenerateRequest, Message, Options
from server.http.errors import APIError, bad_request, from_decode_error
from server.request.input_processor import ModelLimits
from server.request.openai_protocol import ChatCompletionRequest, CompletionRequest, JSONSchemaFormat, ResponseFormat

NO_IMAGES = "this server's model takes no images; send text only"
_MAGIC = (("iVBOR", "image/png"), ("/9j/", "image/jpeg"), ("R0lGOD", "image/gif"), ("UklGR", "image/webp"))


def decode_error(error: msgspec.DecodeError) -> APIError:
    e = from_decode_error(error)
    e.message = e.message.replace("the OpenAI API reference", "Ollama's API reference")
    return e


def sampling(options: Options | None, limits: ModelLimits) -> dict[str, Any]:
    """Ollama's options as the OpenAI request's fields (None where not given: the model's defaults apply)."""
    o = options or Options()
    if o.num_ctx is not None and o.num_ctx > limits.max_model_len:
        raise bad_request(
            f"options.num_ctx is {o.num_ctx}, but this server's context (max_model_len) is {limits.max_model_len} "
            "tokens: ask for at most that, or restart the server with a larger --max-model-len.",
            "options.num_ctx",
        )
    max_tokens = o.num_predict if o.num_predict is not None and o.num_predict >= 0 else None
    return {
        "temperature": o.temperature,
        "top_k": o.top_k,
        "top_p": o.top_p,
        "min_p": o.min_p,
        "max_tokens": max_tokens,
        "stop": o.stop,
        "seed": o.seed,
        "repetition_penalty": o.repeat_penalty,
        "presence_penalty": o.presence_penalty,
        "frequency_penalty": o.frequency_penalty,
    }


def response_format(value: str | dict[str, Any] | None) -> ResponseFormat | None:
    if value is None or value == "":
        return None
    if value == "json":
        return ResponseFormat(type="json_object")
    if isinstance(value, str):
        raise bad_request(f'format must be "json" or a JSON schema object, not {value!r}.', "format")
    return ResponseFormat(type="json_schema", json_schema=JSONSchemaFormat(name="format", schema=value))


def image_url(data: str) -> dict[str, Any]:
    """A base64 image (Ollama sends no media type: read from its first bytes) as an image_url part."""
    media = next((kind for magic, kind in _MAGIC if data.startswith(magic)), "image/png")
    return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}


def _message(i: int, m: Message, images: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.images:
        if not images:
            raise bad_request(f"messages[{i}].images: {NO_IMAGES}.", f"messages[{i}].images")
        out["content"] = [*(image_url(b) for b in m.images), {"type": "text", "text": m.content}]  # images first
    if m.tool_calls:
        out["tool_calls"] = [
            {
                "id": f"call_{i}_{k}",
                "type": "function",
                "function": {"name": c.function.name, "arguments": c.function.arguments},
            }
            for k, c in enumerate(m.tool_calls)
        ]
    if m.thinking:
        out["reasoning_content"] = m.thinking
    if m.tool_name is not None:
        out["name"] = m.tool_name
    return out


def _thinking(think: bool | str | None) -> dict[str, Any] | None:
    """`think` as the templates' switch (Qwen3's enable_thinking; gpt-oss's levels as reasoning_effort)."""
    if think is None:
        return None
    if isinstance(think, str):
        return {"enable_thinking": True, "reasoning_effort": think}
    return {"enable_thinking": think}


def chat_request(req: ChatRequest, limits: ModelLimits, *, images: bool) -> ChatCompletionRequest:
    return ChatCompletionRequest(
        model=req.model,
        stream=req.stream,
        messages=[_message(i, m, images) for i, m in enumerate(req.messages)],
        tools=req.tools,
        response_format=response_format(req.format),
        chat_template_kwargs=_thinking(req.think),
        **sampling(req.options, limits),
    )


def _check_generate(req: GenerateRequest) -> None:
    if req.template:
        raise bad_request("template (a Go template) is not supported: the model's chat template is used.", "template")


def generate_chat(req: GenerateRequest, limits: ModelLimits, *, images: bool) -> ChatCompletionRequest:
    """A templated /api/generate: `system` and `prompt` (and its images) as one exchange through the chat template."""
    _check_generate(req)
    messages = [] if req.system is None else [Message(role="system", content=req.system)]
    messages.append(Message(role="user", content=req.prompt, images=req.images))
    chat = ChatRequest(model=req.model, stream=req.stream, format=req.format, options=req.options, think=req.think)
    chat.messages = messages
    return chat_request(chat, limits, images=images)


def generate_text(req: GenerateRequest, limits: ModelLimits) -> CompletionRequest:
    """A raw (or fill-in-the-middle) /api/generate: the prompt as it is, no template."""
    _check_generate(req)
    if req.images:
        raise bad_request("images need the chat template: drop raw, or send them to /api/chat.", "images")
    return CompletionRequest(
        model=req.model,
        stream=req.stream,
        prompt=req.prompt,
        suffix=req.suffix or None,
        add_special_tokens=not req.raw,
        response_format=response_format(req.format),
        **sampling(req.options, limits),
    )
