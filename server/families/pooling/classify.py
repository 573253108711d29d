"""POST /classify (vLLM's shape) on a classification model (`*ForSequenceClassification`, or --convert classify):
each input's label probabilities (the model's activation: softmax, or sigmoid for one label or multi-label
problems), the most likely label and the number of classes."""

from __future__ import annotations

import numpy as np

from engine.messages import PoolingInfo
from server.families.pooling.finishing import class_scores
from server.families.pooling.inputs import JSONBody, PoolingJob, input_items, list_body, require_task
from server.families.pooling.protocol import ClassificationData, ClassificationResponse, classify_decoder
from server.http.asgi import Send
from server.request.collector import Output
from server.request.openai_protocol import Usage
from server.request.post_route import PostRoute


class ClassifyFormatter(JSONBody):
    def __init__(self, job: PoolingJob, model: str, info: PoolingInfo, use_activation: bool | None) -> None:
        self.job, self.model, self.info, self.use_activation = job, model, info, use_activation

    def final(self, outputs: list[Output], usage: Usage) -> bytes:
        data = []
        labels = self.info.labels
        for out in outputs:
            probs = class_scores(out, self.info, self.use_activation)
            data.append(ClassificationData(out.index, labels[int(np.argmax(probs))], probs.tolist(), len(labels)))
        return list_body(ClassificationResponse, "classify", self.job, self.model, data, usage)


class ClassifyRoute(PostRoute):
    runner = "pooling"

    async def _work(self, body: bytes, xid: str | None, send: Send) -> None:
        req, llm, renderer, limits = self.state.decode_for_model(classify_decoder, body)
        info = require_task(llm, "/classify", ("classify",))
        items = input_items(req.input)
        with PoolingJob.start(
            llm, renderer, limits, xid, req.request_id, req.priority, req.add_special_tokens, model=req.model
        ) as job:
            await job.add_inputs(items, req.truncate_prompt_tokens)
            use = req.use_activation if req.use_activation is not None else req.activation
            await job.respond(ClassifyFormatter(job, self.state.model_name, info, use), send)
