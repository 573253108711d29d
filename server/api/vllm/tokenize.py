"""POST /tokenize and POST /detokenize, in vLLM's shapes.

/tokenize:   {"prompt": str} or {"messages": [...]} (exactly one), plus add_special_tokens (default true for
             a prompt, false for messages: the template places them), add_generation_prompt,
             continue_final_message, chat_template, chat_template_kwargs, tools, documents, return_token_strs
             -> {"count": int, "max_model_len": int, "tokens": [int]} (+ "token_strs" when asked)
/detokenize: {"tokens": [int]} -> {"prompt": str}   (special tokens kept, as vLLM does)
"""

from __future__ import annotations

from typing import Any

import msgspec

from server.http.asgi import Receive, Scope, Send, send_json, serve_json_post
from server.api.vllm.render import chat_prompt_ids, text_prompt_ids
from server.api.state import AppState
from server.http.errors import APIError, bad_request, from_decode_error
from server.pipeline.input_processor import check_prompt_ids
from server.protocol.openai import decode_request, encoder
from server.render.renderer import RendererOverloaded, RenderError


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    documents: list[dict[str, Any]] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[int]
    model: str | None = None


_tokenize_decoder = msgspec.json.Decoder(TokenizeRequest)
_detokenize_decoder = msgspec.json.Decoder(DetokenizeRequest)


class TokenizeRoute:
    def __init__(self, state: AppState) -> None:
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def work(body: bytes) -> None:
            try:
                req = decode_request(_tokenize_decoder, body)
            except msgspec.DecodeError as e:
                raise from_decode_error(e) from None
            _llm, renderer, limits = self.state.require()
            self.state.check_model(req.model)
            if (req.prompt is None) == (req.messages is None):
                raise bad_request("Send exactly one of prompt (a string) or messages (a chat).", "prompt")
            if req.messages is not None:
                ids = await chat_prompt_ids(renderer, req, bool(req.add_special_tokens))
            else:
                special = True if req.add_special_tokens is None else req.add_special_tokens
                ids = await text_prompt_ids(renderer, req.prompt or "", special)
            out: dict[str, Any] = {"count": len(ids), "max_model_len": limits.max_model_len, "tokens": ids}
            if req.return_token_strs:
                out["token_strs"] = [renderer.tokenizer.id_to_token(i) for i in ids]
            await send_json(send, 200, encoder.encode(out))

        await serve_json_post(scope, receive, send, self.state.config.max_request_body, work)


class DetokenizeRoute:
    def __init__(self, state: AppState) -> None:
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def work(body: bytes) -> None:
            try:
                req = decode_request(_detokenize_decoder, body)
            except msgspec.DecodeError as e:
                raise from_decode_error(e) from None
            _llm, renderer, limits = self.state.require()
            self.state.check_model(req.model)
            check_prompt_ids(req.tokens, limits.vocab_size, "tokens")
            try:
                text = await renderer.decode(req.tokens, skip_special_tokens=False)
            except RenderError as e:
                raise bad_request(str(e), "tokens") from None
            except RendererOverloaded as e:
                raise APIError(str(e), status=503, retry_after=1) from None
            await send_json(send, 200, encoder.encode({"prompt": text}))

        await serve_json_post(scope, receive, send, self.state.config.max_request_body, work)
