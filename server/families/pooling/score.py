"""POST /score and /v1/score (vLLM's shape): `queries` against `documents` (text_1 / text_2 and data_1 / data_2
as vLLM's older names), 1:1, 1:N or N:N; a cross-encoder's score or a bi-encoder's cosine per pair."""

from __future__ import annotations

from server.families.pooling.inputs import JSONBody, PoolingJob, list_body, prompt_truncation, require_task
from server.families.pooling.pairs import PairScorer, check_scorer
from server.families.pooling.protocol import ScoreData, ScoreRequest, ScoreResponse, TextList, score_decoder
from server.families.pooling.scoring import pair_up
from server.http.asgi import Send
from server.http.errors import bad_request
from server.request.collector import Output
from server.request.openai_protocol import Usage
from server.request.post_route import PostRoute

_NAMES = (("queries", "documents"), ("text_1", "text_2"), ("data_1", "data_2"))


def score_sides(req: ScoreRequest) -> tuple[list[str], list[str], tuple[str, str]]:
    """The one pair of fields the request uses, as lists, with their names (a 400 for none or several)."""
    given = [(a, b) for a, b in _NAMES if getattr(req, a) is not None or getattr(req, b) is not None]
    if len(given) != 1:
        raise bad_request(
            "Send queries and documents (or text_1 and text_2, or data_1 and data_2), one pair of "
            f"them{'; got ' + ', '.join(a + '/' + b for a, b in given) if given else ''}.",
            "queries",
        )
    names = given[0]
    sides: list[list[str]] = []
    for name in names:
        value: TextList | None = getattr(req, name)
        if value is None:
            raise bad_request(f"{name} is required.", name)
        sides.append([value] if isinstance(value, str) else list(value))
    return sides[0], sides[1], names


class ScoreFormatter(JSONBody):
    def __init__(self, job: PoolingJob, scorer: PairScorer, model: str, use_activation: bool | None) -> None:
        self.job, self.scorer, self.model, self.use_activation = job, scorer, model, use_activation

    def final(self, outputs: list[Output], usage: Usage) -> bytes:
        scores = self.scorer.scores(outputs, self.use_activation)
        return list_body(
            ScoreResponse, "score", self.job, self.model, [ScoreData(i, s) for i, s in enumerate(scores)], usage
        )


class ScoreRoute(PostRoute):
    runner = "pooling"

    async def _work(self, body: bytes, xid: str | None, send: Send) -> None:
        req, llm, renderer, limits = self.state.decode_for_model(score_decoder, body)
        info = require_task(llm, "/score", ("embed", "classify"))
        check_scorer(info, "/score")
        queries, documents, names = score_sides(req)
        pairs = pair_up(queries, documents, names)
        with PoolingJob.start(
            llm, renderer, limits, xid, req.request_id, req.priority, req.add_special_tokens, model=req.model
        ) as job:
            job.check_count(len(pairs), names[1], documents=True)
            cut = prompt_truncation(req.truncate_prompt_tokens, limits, names[1])
            await job.admit([q + d for q, d in pairs])
            scorer = PairScorer(job, info)
            for q, d in pairs:
                await scorer.add(q, d, cut)
            use = req.use_activation if req.use_activation is not None else req.activation
            await job.respond(ScoreFormatter(job, scorer, self.state.model_name, use), send)
