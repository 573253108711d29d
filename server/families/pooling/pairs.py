"""Scores of (query, document) text pairs, every pair's inputs in one engine batch: what /score, /rerank and
Cohere's /v2/rerank share.

A classifier with one label is a cross-encoder: each pair is one input, the two texts joined as its tokenizer
joins a pair, and the score is its logit through the model's activation (sentence-transformers' CrossEncoder:
sigmoid unless the checkpoint names another). An embedding model is a bi-encoder: each distinct text is embedded
once and a pair's score is the cosine similarity of its two embeddings.
"""

from __future__ import annotations

from engine.messages import PoolingInfo
from server.families.pooling.finishing import as_array
from server.families.pooling.inputs import PoolingJob, Truncation
from server.families.pooling.scoring import cosine, cross_score
from server.http.errors import bad_request
from server.request.collector import Output


def check_scorer(info: PoolingInfo, path: str) -> None:
    if info.task == "classify" and len(info.labels) != 1:
        raise bad_request(
            f"{path} needs a cross-encoder (a classifier with one label) or an embedding model; this "
            f"classifier has {len(info.labels)} labels: ask /classify.",
            None,
        )


class PairScorer:
    def __init__(self, job: PoolingJob, info: PoolingInfo) -> None:
        self.job, self.info = job, info
        self.cross = info.task == "classify"
        self._index: dict[tuple[int, str], int] = {}  # bi-encoder: (side, text) -> its output's index
        self.pairs: list[tuple[int, int]] = []  # per pair: its output (cross) or its two outputs' indexes (bi)

    async def add(self, query: str, document: str, cut: Truncation, doc_tokens: int | None = None) -> None:
        """Queue one pair; `doc_tokens`: the document cut to its first tokens first (Cohere's max_tokens_per_doc).

        `cut` (truncate_prompt_tokens) keeps a text's last tokens, as everywhere, but a joined pair's first."""
        k = len(self.pairs)
        if self.cross:
            if doc_tokens is not None:
                document = await self._first_tokens(document, doc_tokens)
            if cut.side is not None:  # a joined pair keeps its start (the query): the document's end goes first
                cut = Truncation(cut.limit, "right", cut.param)
            i = await self.job.add(query, k, cut, pair=document, what="pair")
            self.pairs.append((i, i))
            return
        doc_cut = cut if doc_tokens is None else Truncation(doc_tokens, "right", cut.param)
        q = await self._embed(0, query, cut)
        d = await self._embed(1, document, doc_cut)
        self.pairs.append((q, d))

    async def _embed(self, side: int, text: str, cut: Truncation) -> int:
        key = (side, text)
        if key not in self._index:
            self._index[key] = await self.job.add(text, len(self._index), cut, what="text")
        return self._index[key]

    async def _first_tokens(self, text: str, n: int) -> str:
        """The text of its first `n` tokens (the cross-encoder joins texts, so a document is cut as text)."""
        renderer = self.job.renderer
        ids = await renderer.encode(text, False)
        return text if len(ids) <= n else await renderer.decode(ids[:n], False)

    def scores(self, outputs: list[Output], use_activation: bool | None) -> list[float]:
        """Each pair's score, in pair order (outputs in input order)."""
        if self.cross:
            on = self.info.use_activation if use_activation is None else use_activation
            return [cross_score(as_array(outputs[i]), self.info.score_activation, on) for i, _ in self.pairs]
        return [cosine(as_array(outputs[q]), as_array(outputs[d])) for q, d in self.pairs]
