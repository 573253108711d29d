"""POST /v1/completions/render and POST /v1/chat/completions/render: text in, token ids out, no generation.

For a router that tokenizes here and generates elsewhere (`/inference/v1/generate`). The request body is
exactly a /v1/completions or /v1/chat/completions body; it goes through the same template, tokenizer and
validation (lengths against max_model_len, every sampling field), and the answer is what
`/inference/v1/generate` takes (vLLM's `GenerateRequest` shape):

    {"request_id": str, "token_ids": [int], "sampling_params": {...}, "model": str,
     "stream": bool, "stream_options": {...} | null, "priority": int}

`sampling_params` holds the resolved values (max_tokens null -> the room left in the context; the
model's generation_config defaults filled in) plus n, stop, include_stop_str_in_output,
skip_special_tokens and spaces_between_special_tokens. The chat route answers one such object; the
completions route answers a JSON array with one object per prompt (a list of prompts gives several).
"""

from __future__ import annotations

from typing import Any

import anyio
import msgspec

from server.http.asgi import Receive, Scope, Send, header, send_json, serve_json_post
from server.api.state import AppState
from server.http.errors import APIError, bad_request, from_decode_error
from server.pipeline.admission import min_tokens
from server.pipeline.input_processor import (
    GenerationSpec, build_spec, check_prompt_ids, check_request, completion_prompts, external_request_id,
    max_token_bytes, refuse_before_tokenizing,
)
from server.protocol.openai import (
    ChatCompletionRequest, CompletionRequest, chat_decoder, completion_decoder, decode_request, encoder,
)
from server.render.renderer import RendererOverloaded, RenderError


async def chat_prompt_ids(renderer: Any, req: Any, add_special_tokens: bool) -> list[int]:
    """Render `req.messages` with the chat template and tokenize; RenderError -> 400, overload -> 503."""
    try:
        text = await renderer.render_chat(
            req.messages, add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message, chat_template=req.chat_template,
            chat_template_kwargs=req.chat_template_kwargs, tools=req.tools, documents=req.documents)
        ids: list[int] = await renderer.encode(text, add_special_tokens)
    except RenderError as e:
        raise bad_request(str(e), "messages") from None
    except RendererOverloaded as e:
        raise APIError(str(e), status=503, retry_after=1) from None
    return ids


_token_bytes: dict[int, int] = {}  # id(tokenizer) -> max_token_bytes, read without a thread hop


async def prompts_lower_bound(tokenizer: Any, prompts: list[str | list[int]]) -> int:
    """A lower bound on the tokens of `prompts` without tokenizing them (at least 1 each: empty is refused)."""
    per = 1
    if any(isinstance(p, str) for p in prompts):
        per = _token_bytes.get(id(tokenizer)) or 0
        if not per:  # the vocabulary scan (~150 ms, once) stays off the event loop
            per = _token_bytes[id(tokenizer)] = await anyio.to_thread.run_sync(max_token_bytes, tokenizer)
    return sum(max(1, min_tokens(p, per) if isinstance(p, str) else len(p)) for p in prompts)


def admit_early(state: AppState, llm: Any, num_reqs: int, min_prompt_tokens: int) -> None:
    """503 before rendering/tokenizing when admission would surely refuse (queue full, or the prompt too long).

    The exact, pessimistic check still runs in AsyncLLM.generate once the prompt is tokenized.
    """
    cfg = state.config
    reason = refuse_before_tokenizing(getattr(llm, "admission", None), cfg.max_num_queued_reqs,
                                      cfg.max_num_queued_tokens, num_reqs, min_prompt_tokens)
    if reason is not None:
        if llm.metrics is not None:
            llm.metrics.rejected("queue_full")
        raise APIError(f"The server is overloaded ({reason}); retry after a moment.", status=503, retry_after=1)


async def text_prompt_ids(renderer: Any, text: str, add_special_tokens: bool) -> list[int]:
    try:
        ids: list[int] = await renderer.encode(text, add_special_tokens)
    except RenderError as e:
        raise bad_request(str(e), "prompt") from None
    except RendererOverloaded as e:
        raise APIError(str(e), status=503, retry_after=1) from None
    return ids


def generate_request(spec: GenerationSpec, model: str,
                     req: CompletionRequest | ChatCompletionRequest) -> dict[str, Any]:
    """The /inference/v1/generate body that reproduces `spec`."""
    params = msgspec.to_builtins(spec.params)  # omit_defaults: only what differs from the engine's defaults
    params.pop("prompt_logprobs", None)
    if params.get("logit_bias"):
        params["logit_bias"] = {str(k): v for k, v in spec.params.logit_bias.items()}  # type: ignore[union-attr]
    params.update(n=spec.n, stop=list(spec.stop), include_stop_str_in_output=spec.include_stop_str_in_output,
                  skip_special_tokens=spec.skip_special_tokens,
                  spaces_between_special_tokens=spec.spaces_between_special_tokens,
                  temperature=spec.params.temperature, top_p=spec.params.top_p, top_k=spec.params.top_k,
                  seed=spec.params.seed)
    return {"request_id": spec.external_id, "token_ids": spec.prompt_token_ids, "sampling_params": params,
            "model": model, "stream": req.stream, "stream_options": msgspec.to_builtins(req.stream_options),
            "priority": spec.priority}


class CompletionsRenderRoute:
    def __init__(self, state: AppState) -> None:
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        xid = header(scope, b"x-request-id")

        async def work(body: bytes) -> None:
            try:
                req = decode_request(completion_decoder, body)
            except msgspec.DecodeError as e:
                raise from_decode_error(e) from None
            _llm, renderer, limits = self.state.require()
            self.state.check_model(req.model)
            check_request(req, limits)
            external = external_request_id(xid, req.request_id)
            out = []
            for k, prompt in enumerate(completion_prompts(req.prompt)):
                if isinstance(prompt, str):
                    ids = await text_prompt_ids(renderer, prompt, req.add_special_tokens)
                else:
                    check_prompt_ids(prompt, limits.vocab_size)
                    ids = prompt
                spec = build_spec(req, ids, limits, external_id=external if k == 0 else f"{external}-{k}",
                                  stream=req.stream)
                out.append(generate_request(spec, self.state.model_name, req))
            await send_json(send, 200, encoder.encode(out))

        await serve_json_post(scope, receive, send, self.state.config.max_request_body, work)


class ChatRenderRoute:
    def __init__(self, state: AppState) -> None:
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        xid = header(scope, b"x-request-id")

        async def work(body: bytes) -> None:
            try:
                req = decode_request(chat_decoder, body)
            except msgspec.DecodeError as e:
                raise from_decode_error(e) from None
            _llm, renderer, limits = self.state.require()
            self.state.check_model(req.model)
            if req.messages is None:
                raise bad_request("messages is required: a list of {role, content} objects.", "messages")
            check_request(req, limits)
            ids = await chat_prompt_ids(renderer, req, req.add_special_tokens)
            spec = build_spec(req, ids, limits, external_id=external_request_id(xid, req.request_id),
                              stream=req.stream)
            await send_json(send, 200, encoder.encode(generate_request(spec, self.state.model_name, req)))

        await serve_json_post(scope, receive, send, self.state.config.max_request_body, work)
