"""msgspec Structs for Cohere's v2 embed API (POST /v2/embed), as the official `cohere` SDK's ClientV2.embed
sends and reads them. /v2/rerank shares server/families/pooling/protocol.py's RerankRequest."""

from __future__ import annotations

from typing import Any

import msgspec

from server.request.openai_protocol import Int64


class TextContent(msgspec.Struct, tag="text", tag_field="type"):
    text: str


class ImageUrl(msgspec.Struct):
    url: str


class ImageUrlContent(msgspec.Struct, tag="image_url", tag_field="type"):
    image_url: ImageUrl


class EmbedInput(msgspec.Struct):
    """One input of `inputs`: text and image parts, embedded together."""

    content: list[TextContent | ImageUrlContent]


class EmbedRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    input_type: str | None = None  # search_query, search_document, ...: mapped to the model's prompts
    texts: list[str] | None = None
    images: list[str] | None = None  # data URIs
    inputs: list[EmbedInput] | None = None
    max_tokens: Int64 | None = None  # per input; longer inputs are cut as `truncate` says
    output_dimension: Int64 | None = None
    embedding_types: list[str] | None = None  # None: ["float"]
    truncate: str | None = None  # NONE | START | END (the default)
    priority: Int64 = 0


class ApiVersion(msgspec.Struct):
    version: str = "2"


class BilledUnits(msgspec.Struct, omit_defaults=True):
    input_tokens: int | None = None
    images: int | None = None
    search_units: int | None = None


class ApiMeta(msgspec.Struct):
    api_version: ApiVersion
    billed_units: BilledUnits


class EmbedResponse(msgspec.Struct, omit_defaults=True):
    id: str
    embeddings: dict[str, list[Any]]
    meta: ApiMeta
    texts: list[str] | None = None
    response_type: str = "embeddings_by_type"


embed_decoder = msgspec.json.Decoder(EmbedRequest)
