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

import msgspec

from server.http.asgi import Send, send_json
from server.request.input_processor import (
    GenerationSpec,
    build_spec,
    check_prompt_ids,
    check_request,
    external_request_id,
)
from server.request.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_decoder,
    completion_decoder,
    encoder,
)
from server.request.post_route import PostRoute
from server.request.prompt_shapes import completion_prompts
from server.request.prompt_tokens import chat_ids_with_images, fit_limits, require_messages, text_prompt_ids


def generate_request(
    spec: GenerationSpec, model: str, req: CompletionRequest | ChatCompletionRequest
) -> dict[str, Any]:
    """The /inference/v1/generate body that reproduces `spec`."""
    params = msgspec.to_builtins(spec.params)  # omit_defaults: only what differs from the engine's defaults
    params.pop("prompt_logprobs", None)
    bias = spec.params.logit_bias
    if bias:
        params["logit_bias"] = {str(k): v for k, v in bias.items()}
    params.update(
        n=spec.n,
        stop=list(spec.stop),
        include_stop_str_in_output=spec.include_stop_str_in_output,
        skip_special_tokens=spec.skip_special_tokens,
        spaces_between_special_tokens=spec.spaces_between_special_tokens,
        temperature=spec.params.temperature,
        top_p=spec.params.top_p,
        top_k=spec.params.top_k,
        seed=spec.params.seed,
    )
    return {
        "request_id": spec.external_id,
        "token_ids": spec.prompt_token_ids,
        "sampling_params": params,
        "model": model,
        "stream": req.stream,
        "stream_options": msgspec.to_builtins(req.stream_options),
        "priority": spec.priority,
    }


class CompletionsRenderRoute(PostRoute):
    async def _work(self, body: bytes, xid: str | None, send: Send) -> None:
        req, renderer, limits = self.state.decode_for_render(completion_decoder, body)
        check_request(req, limits)
        external = external_request_id(xid, req.request_id)
        out = []
        for k, prompt in enumerate(completion_prompts(req.prompt)):
            if isinstance(prompt, str):
                ids = await text_prompt_ids(renderer, prompt, req.add_special_tokens, limits=fit_limits(req, limits))
            else:
                check_prompt_ids(prompt, limits.vocab_size)
                ids = prompt
            spec = build_spec(
                req, ids, limits, external_id=external if k == 0 else f"{external}-{k}", stream=req.stream
            )
            out.append(generate_request(spec, self.state.model_name, req))
        await send_json(send, 200, encoder.encode(out))


class ChatRenderRoute(PostRoute):
    async def _work(self, body: bytes, xid: str | None, send: Send) -> None:
        req, renderer, limits = self.state.decode_for_render(chat_decoder, body)
        require_messages(req)
        check_request(req, limits)
        # image parts (a vision model) count as their expanded image tokens; the images themselves are not part
        # of the answer (/inference/v1/generate takes token ids only)
        ids, _ = await chat_ids_with_images(self.state, renderer, req, req.add_special_tokens, fit_limits(req, limits))
        spec = build_spec(req, ids, limits, external_id=external_request_id(xid, req.request_id), stream=req.stream)
        await send_json(send, 200, encoder.encode(generate_request(spec, self.state.model_name, req)))
