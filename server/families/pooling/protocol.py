"""msgspec Structs for vLLM's pooling routes: /classify, /score, /rerank (Jina's and Cohere's v2 shape), /pooling.
Unknown request fields are ignored; usage as OpenAI's (completion_tokens 0)."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from server.request.openai_protocol import Int64


class PoolingBase(msgspec.Struct, kw_only=True):
    """What every pooling request may say (vLLM's names)."""

    model: str | None = None
    truncate_prompt_tokens: Int64 | None = None  # keep the last k tokens of each input; -1: max_model_len
    add_special_tokens: bool = True
    priority: Int64 = 0
    user: str | None = None
    request_id: str | None = None


class ClassificationRequest(PoolingBase, kw_only=True):
    """POST /classify. `input`: a string, a list of strings, token ids, or a list of token-id lists."""

    input: str | list[Any]
    use_activation: bool | None = None  # None: the model's (--pooler-config use_activation)
    activation: bool | None = None  # vLLM's older name for use_activation


class PoolingRequest(PoolingBase, kw_only=True):
    """POST /pooling: the pooler's output itself (ALL / STEP: one row per token)."""

    input: str | list[Any]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int64 | None = None
    normalize: bool | None = None  # embedding models; None: the model's
    use_activation: bool | None = None  # classifiers; None: the model's


TextList = str | list[str]


class ScoreRequest(PoolingBase, kw_only=True):
    """POST /score, /v1/score: queries against documents (1:1, 1:N or N:N); text_1 / text_2 and data_1 / data_2
    are vLLM's older names."""

    queries: TextList | None = None
    documents: TextList | None = None
    text_1: TextList | None = None
    text_2: TextList | None = None
    data_1: TextList | None = None
    data_2: TextList | None = None
    use_activation: bool | None = None
    activation: bool | None = None


class DocumentIn(msgspec.Struct):
    """A document as Jina and Cohere's v1 send it: {"text": ...}."""

    text: str


class RerankRequest(PoolingBase, kw_only=True):
    """POST /rerank, /v1/rerank (Jina), /v2/rerank (Cohere)."""

    query: str | None = None
    documents: list[str | DocumentIn] | None = None
    top_n: Int64 | None = None  # None or 0: every document
    return_documents: bool = True
    max_tokens_per_doc: Int64 | None = None  # Cohere: each document cut to its first k tokens
    use_activation: bool | None = None
    activation: bool | None = None


class PoolingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class ClassificationData(msgspec.Struct):
    index: int
    label: str
    probs: list[float]
    num_classes: int


class ClassificationResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    data: list[ClassificationData]
    usage: PoolingUsage
    object: str = "list"


class ScoreData(msgspec.Struct):
    index: int
    score: float
    object: str = "score"


class ScoreResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    data: list[ScoreData]
    usage: PoolingUsage
    object: str = "list"


class RerankDocument(msgspec.Struct):
    text: str


class RerankResult(msgspec.Struct, omit_defaults=True):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankResponse(msgspec.Struct, omit_defaults=True):
    id: str
    model: str
    usage: PoolingUsage
    results: list[RerankResult]
    meta: dict[str, Any] | None = None  # /v2/rerank: Cohere's api_version and billed_units


class PoolingData(msgspec.Struct):
    index: int
    data: list[float] | list[list[float]] | str  # str: base64 of little-endian float32, row after row
    object: str = "pooling"


class PoolingResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    data: list[PoolingData]
    usage: PoolingUsage
    object: str = "list"


classify_decoder = msgspec.json.Decoder(ClassificationRequest)
pooling_decoder = msgspec.json.Decoder(PoolingRequest)
score_decoder = msgspec.json.Decoder(ScoreRequest)
rerank_decoder = msgspec.json.Decoder(RerankRequest)
