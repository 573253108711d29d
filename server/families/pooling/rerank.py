"""POST /rerank and /v1/rerank (Jina's shape, as vLLM): `query` against `documents`, every document scored in one
engine batch (cross-encoder or bi-encoder: pairs.py), sorted by relevance, the first `top_n`. Cohere's /v2/rerank
is the same route with Cohere's `meta` (server/families/cohere/rerank.py)."""

from __future__ import annotations

from typing import Any

from server.families.pooling.inputs import JSONBody, PoolingJob, Truncation, prompt_truncation, require_task
from server.families.pooling.pairs import PairScorer, check_scorer
from server.families.pooling.protocol import (
    DocumentIn,
    PoolingUsage,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    rerank_decoder,
)
from server.families.pooling.scoring import rerank_order
from server.http.asgi import Send
from server.http.errors import bad_request
from server.request.collector import Output
from server.request.openai_protocol import Usage, encoder
from server.request.post_route import PostRoute


def rerank_inputs(req: RerankRequest) -> tuple[str, list[str]]:
    """The query and the documents' texts; 400s naming the field."""
    if req.query is None:
        raise bad_request("query is required: the text the documents are ranked against.", "query")
    if not req.documents:
        raise bad_request('documents must be a non-empty list of texts (or {"text": ...} objects).', "documents")
    if req.top_n is not None and req.top_n < 0:
        raise bad_request(f"top_n must be at least 0 (0 or none: every document), got {req.top_n}.", "top_n")
    if req.max_tokens_per_doc is not None and req.max_tokens_per_doc < 1:
        raise bad_request(f"max_tokens_per_doc must be at least 1, got {req.max_tokens_per_doc}.", "max_tokens_per_doc")
    return req.query, [d.text if isinstance(d, DocumentIn) else d for d in req.documents]


class RerankFormatter(JSONBody):
    def __init__(
        self,
        job: PoolingJob,
        scorer: PairScorer,
        model: str,
        req: RerankRequest,
        documents: list[str],
        meta: dict[str, Any] | None,
    ) -> None:
        self.job, self.scorer, self.model, self.req, self.documents, self.meta = (
            job,
            scorer,
            model,
            req,
            documents,
            meta,
        )

    def final(self, outputs: list[Output], usage: Usage) -> bytes:
        req = self.req
        use = req.use_activation if req.use_activation is not None else req.activation
        scores = self.scorer.scores(outputs, use)
        results = [
            RerankResult(i, scores[i], RerankDocument(self.documents[i]) if req.return_documents else None)
            for i in rerank_order(scores, req.top_n)
        ]
        return encoder.encode(
            RerankResponse(
                f"rerank-{self.job.external}",
                self.model,
                PoolingUsage(usage.prompt_tokens, usage.prompt_tokens),
                results,
                self.meta,
            )
        )


class RerankRoute(PostRoute):
    runner = "pooling"
    path = "/rerank"

    async def _work(self, body: bytes, xid: str | None, send: Send) -> None:
        req, llm, renderer, limits = self.state.decode_for_model(rerank_decoder, body)
        info = require_task(llm, self.path, ("embed", "classify"))
        check_scorer(info, self.path)
        query, documents = rerank_inputs(req)
        with PoolingJob.start(
            llm, renderer, limits, xid, req.request_id, req.priority, req.add_special_tokens, model=req.model
        ) as job:
            job.check_count(len(documents), "documents", documents=True)
            cut: Truncation = prompt_truncation(req.truncate_prompt_tokens, limits, "documents")
            await job.admit([query + d for d in documents])
            scorer = PairScorer(job, info)
            for d in documents:
                await scorer.add(query, d, cut, req.max_tokens_per_doc)
            fmt = RerankFormatter(job, scorer, self.state.model_name, req, documents, self.meta(len(documents)))
            await job.respond(fmt, send)

    def meta(self, num_documents: int) -> dict[str, Any] | None:
        """What the answer adds beside Jina's shape (Cohere's v2: its meta)."""
        return None
