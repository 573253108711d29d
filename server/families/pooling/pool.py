"""POST /pooling (vLLM's shape): the pooler's output itself, one `data` per input: a vector for LAST / CLS / MEAN,
one row per token for ALL (per step tag for STEP). An embedding model's rows are cut to `dimensions` and
normalized as /v1/embeddings' (the model's default, or the request's `normalize`); a classifier's go through its
activation (or not: `use_activation`). Floats, or base64 of the little-endian float32 values row after row."""

from __future__ import annotations

from engine.messages import PoolingInfo
from server.families.pooling.finishing import check_dimensions, class_scores, embedding, encode_vector
from server.families.pooling.inputs import JSONBody, PoolingJob, input_items, list_body, require_task
from server.families.pooling.protocol import PoolingData, PoolingRequest, PoolingResponse, pooling_decoder
from server.http.asgi import Send
from server.http.errors import bad_request
from server.request.collector import Output
from server.request.openai_protocol import Usage
from server.request.post_route import PostRoute


class PoolingFormatter(JSONBody):
    def __init__(self, job: PoolingJob, model: str, info: PoolingInfo, req: PoolingRequest, dims: int | None) -> None:
        self.job, self.model, self.info, self.req, self.dims = job, model, info, req, dims

    def final(self, outputs: list[Output], usage: Usage) -> bytes:
        req, info = self.req, self.info
        b64 = req.encoding_format == "base64"
        data = []
        for out in outputs:
            if info.task == "classify":
                v = class_scores(out, info, req.use_activation)
            else:
                v = embedding(out, self.dims, info.normalize if req.normalize is None else req.normalize)
            data.append(PoolingData(out.index, encode_vector(v, b64)))
        return list_body(PoolingResponse, "pool", self.job, self.model, data, usage)


class PoolingRoute(PostRoute):
    runner = "pooling"

    async def _work(self, body: bytes, xid: str | None, send: Send) -> None:
        req, llm, renderer, limits = self.state.decode_for_model(pooling_decoder, body)
        info = require_task(llm, "/pooling", ("embed", "classify"), single=False)
        if req.dimensions is not None and info.task != "embed":
            raise bad_request("dimensions applies to embedding models; this server runs a classifier.", "dimensions")
        dims = check_dimensions(req.dimensions, info, "dimensions")
        items = input_items(req.input)
        with PoolingJob.start(
            llm, renderer, limits, xid, req.request_id, req.priority, req.add_special_tokens, model=req.model
        ) as job:
            await job.add_inputs(items, req.truncate_prompt_tokens)
            await job.respond(PoolingFormatter(job, self.state.model_name, info, req, dims), send)
