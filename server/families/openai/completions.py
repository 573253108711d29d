"""POST /v1/completions."""

from __future__ import annotations

import time

from server.http import sse
from server.http.asgi import Send
from server.http.errors import bad_request
from server.render.renderer import Renderer
from server.request.collector import Output
from server.request.fim import fim_prompt_ids, require_fim
from server.request.input_processor import (
    GenerationSpec,
    ModelLimits,
    build_spec,
    check_prompt_ids,
    check_request,
    external_request_id,
)
from server.request.logprobs import TokenTexts, completion_logprobs
from server.request.openai_protocol import (
    CompletionChoice,
    CompletionChoiceIds,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    Usage,
    completion_decoder,
    encoder,
)
from server.request.post_route import PostRoute
from server.request.prompt_shapes import completion_prompts
from server.request.prompt_tokens import admit_prompts, fit_limits, render_errors, text_prompt_ids
from server.structured.chat_plan import respond_checked
from server.structured.constraint import Constraint, structured_outputs
from server.structured.output_check import relaxed_check, relaxed_headers

_enc = encoder.encode


class CompletionFormatter:
    direct_ok = True  # stateless per output: the output handler may write chunks itself

    def __init__(
        self,
        request_id: str,
        created: int,
        model: str,
        *,
        echo: dict[int, str],
        texts: TokenTexts | None,
        first_prompt_ids: dict[int, int] | None = None,
        prompt_ids: dict[int, list[int]] | None = None,
    ) -> None:
        self.id = request_id
        self.created = created
        self.model = model
        self.echo = echo  # choice index -> prompt text to put in front
        self.texts = texts  # set when logprobs were asked for
        self.offsets: dict[int, int] = {}
        self.first_prompt_ids = first_prompt_ids or {}  # echo + logprobs: the prompt token without a logprob
        self.prompt_ids = prompt_ids  # return_token_ids: choice index -> prompt ids (None: not asked)
        self._plain = texts is None and prompt_ids is None  # the fast path applies to unfinished outputs
        head = _enc({"id": request_id, "object": "text_completion", "created": created, "model": model})
        self._prefix = b"data: " + head[:-1] + b',"choices":['

    def _text(self, out: Output) -> str:
        if out.first and self.echo:
            return self.echo.get(out.index, "") + out.text
        return out.text

    def _logprobs(self, out: Output, into: CompletionLogprobs | None = None) -> CompletionLogprobs | None:
        if self.texts is None:
            return None
        offset = self.offsets.get(out.index)
        if offset is None:
            offset = 0
            if out.prompt_logprobs is not None and out.index in self.echo:  # echo: the prompt's logprobs first
                first = self.texts(self.first_prompt_ids.get(out.index, 0))
                into, offset = completion_logprobs(out.prompt_logprobs, self.texts, 0, into, first)
            else:
                offset = len(self.echo.get(out.index, ""))
        lp, self.offsets[out.index] = completion_logprobs(out.logprobs or [], self.texts, offset, into)
        return lp

    def _choice(self, out: Output) -> CompletionChoice:
        if self.prompt_ids is None:
            return CompletionChoice(out.index, self._text(out), self._logprobs(out), out.finish_reason, out.stop_reason)
        return CompletionChoiceIds(
            out.index,
            self._text(out),
            self._logprobs(out),
            out.finish_reason,
            out.stop_reason,
            out.token_ids,
            self.prompt_ids.get(out.index) if out.first else None,
        )

    def stream_start(self) -> bytes | None:
        return None

    def stream_chunk(self, batch: list[Output], usage: Usage | None) -> bytes | None:
        if usage is None and len(batch) == 1 and self._plain and batch[0].finish_reason is None:
            return b"%s%s]}\n\n" % (self._prefix, self._plain_choice(batch[0]))  # the per-token case
        parts = [
            self._plain_choice(out) if out.finish_reason is None and self._plain else _enc(self._choice(out))
            for out in batch
        ]
        tail = b"]}\n\n" if usage is None else b'],"usage":' + _enc(usage) + b"}\n\n"
        return self._prefix + b",".join(parts) + tail

    def _plain_choice(self, out: Output) -> bytes:  # the hot path: no objects, one encode
        return b'{"index":%d,"text":%s,"logprobs":null,"finish_reason":null,"stop_reason":null}' % (
            out.index,
            _enc(self._text(out)),
        )

    def usage_chunk(self, usage: Usage) -> bytes:
        return sse.frame(_enc(CompletionStreamResponse(self.id, self.created, self.model, [], usage=usage)))

    def final(self, outputs: list[Output], usage: Usage) -> bytes:
        choices = [self._choice(o) for o in outputs]
        return _enc(CompletionResponse(self.id, self.created, self.model, choices, usage))


async def suffix_prompt_ids(renderer: Renderer, prompt: str | list[int], suffix: str) -> list[int]:
    """`prompt` + `suffix` as a fill-in-the-middle prompt in the model's FIM tokens (400 without them)."""
    tokens = require_fim(renderer.tokenizer, "suffix")
    if not isinstance(prompt, str):
        raise bad_request("suffix takes a text prompt, not token ids.", "suffix")
    return await fim_prompt_ids(renderer, tokens, prompt, suffix)  # build_spec checks its length


class CompletionsRoute(PostRoute):
    runner = "generate"

    async def _work(self, body: bytes, xid: str | None, send: Send) -> None:
        req, llm, renderer, limits = self.state.decode_for_model(completion_decoder, body)
        check_request(req, limits)
        if req.echo and req.stream and req.logprobs is not None:
            raise bad_request("echo with logprobs is not supported when streaming; drop one of them.", "echo")
        constraint = await structured_outputs(req, limits.caps, tokenizer=renderer.tokenizer)
        external = external_request_id(xid, req.request_id)
        prompts = completion_prompts(req.prompt)
        # the request's one admission ticket, at a lower bound of its prompts: a 503 now when the queue is surely full
        with await admit_prompts(llm, req.n, prompts, renderer.tokenizer) as ticket:
            specs, echo, first_ids, prompt_ids = await self._specs(req, prompts, renderer, limits, external, constraint)
            texts = self.token_texts(renderer, req.logprobs is not None)
            fmt = CompletionFormatter(
                f"cmpl-{external}",
                int(time.time()),
                self.state.shown_model(req.model),
                echo=echo,
                texts=texts,
                first_prompt_ids=first_ids,
                prompt_ids=prompt_ids if req.return_token_ids else None,
            )
            headers = [(b"x-request-id", external.encode()), *relaxed_headers(constraint, {})]
            check = relaxed_check(llm.metrics, constraint, {})
            keepalive = self.state.config.outputs.sse_keepalive
            await respond_checked(llm, specs, fmt, check, send, req, headers, ticket, keepalive=keepalive)

    async def _specs(
        self,
        req: CompletionRequest,
        prompts: list[str | list[int]],
        renderer: Renderer,
        limits: ModelLimits,
        external: str,
        constraint: Constraint | None,
    ) -> tuple[list[GenerationSpec], dict[int, str], dict[int, int], dict[int, list[int]]]:
        """One spec per prompt (tokenized here), and per choice the echoed text, first prompt id and prompt ids."""
        specs, echo, first_ids = [], {}, {}
        prompt_ids: dict[int, list[int]] = {}
        with render_errors("prompt"):
            for k, prompt in enumerate(prompts):
                if req.suffix is not None:
                    ids = await suffix_prompt_ids(renderer, prompt, req.suffix)
                elif isinstance(prompt, str):
                    ids = await text_prompt_ids(
                        renderer, prompt, req.add_special_tokens, limits=fit_limits(req, limits)
                    )
                else:
                    check_prompt_ids(prompt, limits.vocab_size)
                    ids = prompt
                spec = build_spec(
                    req,
                    ids,
                    limits,
                    external_id=external,
                    stream=req.stream,
                    index_offset=k * req.n,
                    structured_outputs=constraint.so if constraint is not None else None,
                )
                specs.append(spec)
                if req.echo:
                    text = prompt if isinstance(prompt, str) else await renderer.decode(ids, req.skip_special_tokens)
                    echo.update({spec.index_offset + i: text for i in range(req.n)})
                    first_ids.update({spec.index_offset + i: spec.prompt_token_ids[0] for i in range(req.n)})
                if req.return_token_ids:
                    prompt_ids.update({spec.index_offset + i: spec.prompt_token_ids for i in range(req.n)})
        return specs, echo, first_ids, prompt_ids
