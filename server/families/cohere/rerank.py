"""POST /v2/rerank (Cohere's v2, as vLLM serves it): /rerank's request and answer (results with index,
relevance_score and the document) plus Cohere's meta: the API version and one search unit per 100 documents."""

from __future__ import annotations

from typing import Any

from server.families.pooling.rerank import RerankRoute

DOCUMENTS_PER_SEARCH_UNIT = 100  # Cohere bills a search unit per query and up to 100 documents


class CohereRerankRoute(RerankRoute):
    path = "/v2/rerank"

    def meta(self, num_documents: int) -> dict[str, Any] | None:
        units = -(-num_documents // DOCUMENTS_PER_SEARCH_UNIT)
        return {"api_version": {"version": "2"}, "billed_units": {"search_units": units}}
