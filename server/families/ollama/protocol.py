"""Ollama's wire structs: the request bodies of /api/chat, /api/generate, /api/embed, /api/embeddings and
/api/show. Unknown fields (and unknown `options`) are ignored, as Ollama ignores them."""

from __future__ import annotations

from typing import Any

import msgspec

from server.families.ollama.keep_alive import KeepAlive
from server.request.openai_protocol import Int64


class Options(msgspec.Struct, kw_only=True):
    """The `options` this server honours; the rest of Ollama's (num_gpu, mirostat, ...) are ignored."""

    temperature: float | None = None
    top_k: Int64 | None = None
    top_p: float | None = None
    min_p: float | None = None
    num_predict: Int64 | None = None  # -1: no limit, -2: fill the context (both: up to max_model_len)
    stop: list[str] | None = None
    seed: Int64 | None = None
    num_ctx: Int64 | None = None  # the context the client expects: at most max_model_len
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


class ToolFunction(msgspec.Struct):
    name: str
    arguments: dict[str, Any] = msgspec.field(default_factory=dict)


class ToolCall(msgspec.Struct):
    function: ToolFunction


class Message(msgspec.Struct, kw_only=True):
    role: str
    content: str = ""
    images: list[str] | None = None  # base64, without a data: prefix
    tool_calls: list[ToolCall] | None = None
    thinking: str | None = None
    tool_name: str | None = None


class _Generation(msgspec.Struct, kw_only=True):
    model: str | None = None
    stream: bool = True  # Ollama streams unless told not to
    format: str | dict[str, Any] | None = None  # "json" or a JSON schema
    options: Options | None = None
    keep_alive: KeepAlive = None
    think: bool | str | None = None


class ChatRequest(_Generation, kw_only=True):
    messages: list[Message] = msgspec.field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


class GenerateRequest(_Generation, kw_only=True):
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None  # a Go template: refused unless empty
    context: list[Int64] | None = None  # a previous answer's `context` (token ids): the prompt continues it
    raw: bool = False
    images: list[str] | None = None


class EmbedRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    input: str | list[str] = ""
    truncate: bool = True
    dimensions: Int64 | None = None
    options: Options | None = None
    keep_alive: KeepAlive = None


class EmbeddingsRequest(msgspec.Struct, kw_only=True):
    """The older /api/embeddings: one prompt, one vector, not normalized."""

    model: str | None = None
    prompt: str = ""
    options: Options | None = None
    keep_alive: KeepAlive = None


class ShowRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    name: str | None = None  # the older spelling of `model`
    verbose: bool = False


chat_decoder = msgspec.json.Decoder(ChatRequest)
generate_decoder = msgspec.json.Decoder(GenerateRequest)
embed_decoder = msgspec.json.Decoder(EmbedRequest)
embeddings_decoder = msgspec.json.Decoder(EmbeddingsRequest)
show_decoder = msgspec.json.Decoder(ShowRequest)
encoder = msgspec.json.Encoder()
