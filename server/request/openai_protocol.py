"""msgspec Structs for the OpenAI wire format (plus vLLM's extras). Unknown request fields are ignored."""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

import msgspec

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
# Request integers outside msgpack's int64 would fail packing for the engine (a 500): a decode 400 instead.
Int64 = Annotated[int, msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)]

# ----------------------------------------------------------------------------------------- requests


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class JSONSchemaFormat(msgspec.Struct, kw_only=True):
    """response_format.json_schema (OpenAI). `schema` is required in practice: its absence is a 400."""

    name: str
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None  # enforced either way: the backend has no best-effort mode


class ResponseFormat(msgspec.Struct, kw_only=True):
    """OpenAI's response_format: text (no constraint), json_object (any JSON object) or json_schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsParams(msgspec.Struct, kw_only=True):
    """vLLM's `structured_outputs`: at most one of json / regex / choice / grammar / json_object.

    `disable_any_whitespace` and `disable_fallback` hold as given (JSON is always compiled without free
    whitespace, and there is one backend); `disable_additional_properties` closes the schema's objects; the
    options the backend cannot honour (structural_tag) are refused (400); whitespace_pattern is the whitespace a
    JSON constraint allows between tokens.
    """

    json: str | dict[str, Any] | None = None  # a JSON schema, as an object or as JSON text
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark, or GBNF / EBNF (converted)
    json_object: bool | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False  # true: objects without additionalProperties get false
    whitespace_pattern: str | None = None  # json / json_object: the whitespace allowed between tokens
    structural_tag: str | None = None  # refused when set


class _GenerationRequest(msgspec.Struct, kw_only=True):
    """Fields shared by /v1/completions and /v1/chat/completions. None means 'not given'."""

    model: str | None = None
    max_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: Int64 = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extras
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int64 = 0
    stop_token_ids: list[Int64] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    allowed_token_ids: list[Int64] | None = None
    priority: Int64 = 0
    request_id: str | None = None
    truncate_prompt_tokens: Int64 | None = None
    return_token_ids: bool = False  # vLLM: choices carry token_ids (and prompt_token_ids)
    # constrained decoding (server/structured/constraint.py): at most one constraint per request
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: str | dict[str, Any] | None = None  # vLLM's older spellings of structured_outputs.*
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None  # as structured_outputs.whitespace_pattern
    guided_decoding_backend: str | None = None  # accepted, not used: one backend (llguidance)


class CompletionRequest(_GenerationRequest, kw_only=True):
    # str | list[str] | list[int] | list[list[int]]: msgspec allows one array type per union, checked later.
    prompt: str | list[Any] | None = None
    logprobs: Int64 | None = None
    echo: bool = False
    add_special_tokens: bool = True
    suffix: str | None = None  # fill-in-the-middle: the text after the gap (server/request/fim.py)


class ChatCompletionRequest(_GenerationRequest, kw_only=True):
    messages: list[dict[str, Any]] | None = None
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the template already placed bos/eos
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None  # vLLM's: min_pixels / max_pixels for images
    tools: list[dict[str, Any]] | None = None
    # "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}} (server/tools/choice.py)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # False: "required" writes exactly one call; a named choice always one
    documents: list[dict[str, Any]] | None = None


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    """POST /v1/embeddings. `input`: a string, a list of strings, token ids, or a list of token-id lists."""

    input: str | list[Any]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int64 | None = None  # Matryoshka truncation, where the model declares it
    user: str | None = None
    add_special_tokens: bool = True  # vLLM's extra
    truncate_prompt_tokens: Int64 | None = None  # vLLM's: keep the last k tokens; -1: max_model_len
    normalize: bool | None = None  # vLLM's: L2-normalize (None: the model's default)


# ---------------------------------------------------------------------------------------- responses


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class ReasoningUsage(Usage):
    """Chat's usage with --reasoning-parser: how many completion tokens wrote reasoning."""

    completion_tokens_details: CompletionTokensDetails | None = None


class EmbeddingData(msgspec.Struct):
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32
    object: str = "embedding"


class EmbeddingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(msgspec.Struct):
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage
    object: str = "list"


class CompletionLogprobs(msgspec.Struct):
    text_offset: list[int] = msgspec.field(default_factory=list)
    token_logprobs: list[float | None] = msgspec.field(default_factory=list)
    tokens: list[str] = msgspec.field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = msgspec.field(default_factory=list)


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob] | None = None


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionChoiceIds(CompletionChoice):
    """With return_token_ids (vLLM)."""

    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class CompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: str = "text_completion"
    system_fingerprint: str | None = None


class CompletionStreamResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: str = "text_completion"
    usage: Usage | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | None
    tool_calls: list[Any] = msgspec.field(default_factory=list)
    refusal: str | None = None


class ChatMessageReasoning(ChatMessage):
    """With --reasoning-parser: the reasoning text, under vLLM's name and its older alias."""

    reasoning: str | None = None
    reasoning_content: str | None = None


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatChoiceIds(ChatChoice):
    """With return_token_ids (vLLM)."""

    token_ids: list[int] | None = None


class ChatCompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    object: str = "chat.completion"
    system_fingerprint: str | None = None


class DeltaMessage(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None  # --reasoning-parser (and its alias reasoning_content)
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # {"index", "id"?, "type"?, "function": {"name"?, "arguments"}}


class ChatStreamChoice(msgspec.Struct):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatStreamChoiceIds(ChatStreamChoice):
    """With return_token_ids (vLLM)."""

    token_ids: list[int] | None = None


class ChatCompletionStreamResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatStreamChoice]
    object: str = "chat.completion.chunk"
    usage: Usage | None = None


class ModelCardBase(msgspec.Struct):
    """What every /v1/models card says (a --models-dir server's adds whether the model is loaded)."""

    id: str
    created: int
    owned_by: str
    root: str
    max_model_len: int


class ModelCard(ModelCardBase):
    object: str = "model"
    parent: str | None = None
    # the sampling values used for fields a request leaves out (--generation-config; absent before the load)
    sampling_defaults: dict[str, float | int] | None = None


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


encoder = msgspec.json.Encoder()
completion_decoder = msgspec.json.Decoder(CompletionRequest)
chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)
embedding_decoder = msgspec.json.Decoder(EmbeddingRequest)

T = TypeVar("T")


def decode_request(decoder: msgspec.json.Decoder[T], body: bytes) -> T:
    """Decode a request body; every malformed body is a msgspec.DecodeError (a 400), never a 500."""
    try:
        return decoder.decode(body)
    except RecursionError:  # msgspec recurses into Any-typed fields such as prompt / content
        raise msgspec.DecodeError("JSON is nested too deeply; flatten the request") from None
