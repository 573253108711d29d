"""What the pooling routes share before the engine: the pooling model's task, inputs tokenized (texts, text pairs,
token ids) and cut as the request says, one FINAL_ONLY engine request per input, and the answer as one JSON body.

Every input goes the way a completion prompt goes: a text surely too long is refused before tokenizing, the
tokenizer workers take long texts, token ids are checked against the vocabulary, the early and exact admission
checks run, and `respond` sends the inputs to the engine together (one batch) and collects their outputs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from engine.messages import ImageInput, LoRARequest, PoolingInfo, SamplingParams
from server.families.pooling.protocol import PoolingUsage
from server.http.asgi import Send
from server.http.errors import bad_request
from server.render.renderer import Renderer
from server.request.admission import AdmissionTicket
from server.request.async_llm import AsyncLLM
from server.request.collector import Output, OutputKind
from server.request.input_processor import (
    GenerationSpec,
    ModelLimits,
    check_priority,
    check_prompt_ids,
    external_request_id,
    lora_for,
    too_many,
    unique_prefix,
)
from server.request.openai_protocol import Usage, encoder
from server.request.prompt_shapes import prompt_items
from server.request.prompt_tokens import admit_prompts, prompts_lower_bound, render_errors
from server.request.respond import respond

_ONE = SamplingParams(max_tokens=1)  # the engine runs the prompt only (runner "pooling" ignores max_tokens)
Item = str | list[int]


def input_items(value: str | list[Any], param: str = "input") -> list[Item]:
    """The four `input` shapes -> one text or token-id list per input."""
    return prompt_items(value, param)


def require_task(llm: AsyncLLM, path: str, tasks: tuple[str, ...], single: bool = True) -> PoolingInfo:
    """The engine's pooling task and pooler; a 400 when this route needs another task, or one vector per input
    (`single`) from an ALL / STEP pooler."""
    info = llm.ready.pooling
    if info is None:  # a route on the generation server is refused before this (PostRoute.check_runner)
        raise bad_request(f"{path} needs a server started with --runner pooling.", None)
    if info.task not in tasks:
        have = "a classification model" if info.task == "classify" else "an embedding model"
        want = " or ".join(
            "an embedding model"
            if t == "embed"
            else "a classification model (a *ForSequenceClassification checkpoint, --convert classify)"
            for t in tasks
        )
        raise bad_request(f"{path} needs {want}; this server runs {have}.", None)
    if single and info.pooling_type in ("ALL", "STEP"):
        raise bad_request(
            f"{path} needs one vector per input; this server pools {info.pooling_type} (one per token): ask /pooling.",
            None,
        )
    return info


@dataclass(frozen=True)
class Truncation:
    """Inputs longer than `limit` tokens: cut on `side` ("left" keeps the last tokens, "right" the first), or
    refused (side None)."""

    limit: int
    side: str | None = None
    param: str = "input"
    limit_name: str = "This model's maximum context length"

    def apply(self, ids: list[int], k: int, what: str) -> list[int]:
        if len(ids) <= self.limit:
            return ids
        if self.side == "left":
            return ids[-self.limit :]
        if self.side == "right":
            return ids[: self.limit]
        raise self.too_long(f"{len(ids)} tokens", k, what)

    def too_long(self, count: str, k: int, what: str) -> Exception:
        return bad_request(
            f"{self.limit_name} is {self.limit} tokens. However, {what} {k} has "
            f"{count}. Please reduce the length of the input.",
            self.param,
        )


def prompt_truncation(value: int | None, limits: ModelLimits, param: str = "input") -> Truncation:
    """vLLM's truncate_prompt_tokens: None refuses what does not fit; -1 keeps the last max_model_len tokens,
    k the last k."""
    if value is None:
        return Truncation(limits.max_model_len, None, param)
    if value == -1:
        return Truncation(limits.max_model_len, "left", param)
    if not 1 <= value <= limits.max_model_len:
        raise bad_request(
            f"truncate_prompt_tokens must be -1 (max_model_len) or between 1 and the maximum context "
            f"length {limits.max_model_len}, got {value}.",
            "truncate_prompt_tokens",
        )
    return Truncation(value, "left", param)


@dataclass
class PoolingJob:
    """One request's engine inputs, one FINAL_ONLY spec per input in order (`index` is its output's index)."""

    llm: AsyncLLM
    renderer: Renderer
    limits: ModelLimits
    external: str
    priority: int = 0
    add_special_tokens: bool = True
    specs: list[GenerationSpec] = field(default_factory=list)
    lora: LoRARequest | None = None  # the adapter the request's `model` names
    ticket: AdmissionTicket | None = None  # taken by `admit`; none: `respond` admits the exact count at once

    @classmethod
    def start(
        cls,
        llm: AsyncLLM,
        renderer: Renderer,
        limits: ModelLimits,
        xid: str | None,
        body_id: str | None,
        priority: int = 0,
        add_special_tokens: bool = True,
        *,
        model: str | None = None,
    ) -> PoolingJob:
        check_priority(priority, limits.caps)
        return cls(
            llm,
            renderer,
            limits,
            external_request_id(xid, body_id),
            priority,
            add_special_tokens,
            lora=lora_for(limits, model),
        )

    def check_count(self, count: int, param: str, documents: bool = False) -> None:
        """Inputs per request: --max-prompts-per-request, or --max-documents-per-request for /score and /rerank."""
        caps = self.limits.caps
        if documents:
            too_many("Number of documents", count, caps.max_documents_per_request, "--max-documents-per-request", param)
        else:
            too_many("Number of inputs", count, caps.max_prompts_per_request, "--max-prompts-per-request", param)

    async def admit(self, items: list[Item]) -> None:
        """The request's admission ticket at a lower bound of these inputs: a 503 before tokenizing when the queue
        surely has no room (held until the job's `with` ends; `respond` settles it at the exact count)."""
        self.ticket = await admit_prompts(self.llm, 1, items, self.renderer.tokenizer, self.ticket)

    async def add_inputs(self, items: list[Item], truncate_prompt_tokens: int | None) -> None:
        """A list of inputs, each its own output: counted, admitted at their lower bound, then tokenized and queued."""
        self.check_count(len(items), "input")
        cut = prompt_truncation(truncate_prompt_tokens, self.limits)
        await self.admit(items)
        for k, item in enumerate(items):
            await self.add(item, k, cut)

    def __enter__(self) -> PoolingJob:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        if self.ticket is not None:
            self.ticket.release()

    async def add(self, item: Item, k: int, cut: Truncation, pair: str | None = None, what: str = "input") -> int:
        """Tokenize a text (with `pair`: the two texts as the tokenizer joins them) or check token ids; cut or
        refuse what is too long; queue it. Returns its output index."""
        if isinstance(item, list):
            check_prompt_ids(item, self.limits.vocab_size, cut.param)
            ids = item
        else:
            if cut.side is None:  # a text surely too long is refused before tokenizing
                texts: list[Item] = [item] if pair is None else [item + pair]
                bound = await prompts_lower_bound(self.renderer.tokenizer, texts)
                if bound > cut.limit:
                    raise cut.too_long(f"at least {bound} tokens", k, what)
            with render_errors(cut.param):
                if pair is None:
                    ids = await self.renderer.encode(item, self.add_special_tokens)
                else:
                    ids = await self.renderer.encode_pair(item, pair, self.add_special_tokens)
        return self.add_ids(cut.apply(ids, k, what), k, cut.param, what)

    def add_ids(
        self, ids: list[int], k: int, param: str, what: str = "input", mm_inputs: list[ImageInput] | None = None
    ) -> int:
        if not ids:
            raise bad_request(f"{what} {k} is empty after tokenization; send at least one token.", param)
        if len(ids) > self.limits.max_model_len:
            Truncation(self.limits.max_model_len, None, param).apply(ids, k, what)
        index = len(self.specs)
        self.specs.append(
            GenerationSpec(
                external_id=self.external,
                request_id=f"{unique_prefix()}-{self.external}",
                prompt_token_ids=ids,
                params=_ONE,
                output_kind=OutputKind.FINAL_ONLY,
                priority=self.priority,
                arrival_time=time.time(),
                index_offset=index,
                mm_inputs=mm_inputs,
                lora=self.lora,
            )
        )
        return index

    async def respond(self, fmt: JSONBody, send: Send) -> None:
        """Run every input in one go (one engine batch) and answer `fmt`'s body."""
        await respond(
            self.llm,
            self.specs,
            fmt,
            send,
            stream=False,
            headers=[(b"x-request-id", self.external.encode())],
            ticket=self.ticket,
        )


class JSONBody:
    """A `respond` formatter for a route that answers one JSON body (pooling routes never stream)."""

    direct_ok = True  # never streamed: nothing to write directly

    def final(self, outputs: list[Output], usage: Usage) -> bytes:
        raise NotImplementedError

    def stream_start(self) -> bytes | None:
        return None

    def stream_chunk(self, batch: list[Output], usage: Usage | None) -> bytes | None:
        return None

    def usage_chunk(self, usage: Usage) -> bytes:
        return b""


def list_body(
    response: Callable[..., Any], id_prefix: str, job: PoolingJob, model: str, data: list[Any], usage: Usage
) -> bytes:
    """A pooling route's list answer as JSON: `response(id, created, model, data, usage)`, its id
    `{id_prefix}-{request id}`, its usage the prompt tokens."""
    used = PoolingUsage(usage.prompt_tokens, usage.prompt_tokens)
    return encoder.encode(response(f"{id_prefix}-{job.external}", int(time.time()), model, data, used))
