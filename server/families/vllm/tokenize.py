"""POST /tokenize and POST /detokenize, in vLLM's shapes.

/tokenize:   {"prompt": str} or {"messages": [...]} (exactly one), plus add_special_tokens (default true for
             a prompt, false for messages: the template places them), add_generation_prompt,
             continue_final_message, chat_template, chat_template_kwargs, tools, documents, return_token_strs,
             mm_processor_kwargs; on a vision model messages may hold image parts, counted as their expanded
             image tokens
             -> {"count": int, "max_model_len": int, "tokens": [int]} (+ "token_strs" when asked)
/detokenize: {"tokens": [int]} -> {"prompt": str}   (special tokens kept, as vLLM does)
"""

from __future__ import annotations

from typing import Any

import msgspec

from server.http.asgi import Send, send_json
from server.http.errors import bad_request
from server.request.input_processor import check_prompt_ids
from server.request.openai_protocol import encoder
from server.request.post_route import PostRoute
from server.request.prompt_tokens import chat_ids_with_images, render_errors, text_prompt_ids


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
    mm_processor_kwargs: dict[str, Any] | None = None  # images (a vision model): min_pixels / max_pixels


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[int]
    model: str | None = None


_tokenize_decoder = msgspec.json.Decoder(TokenizeRequest)
_detokenize_decoder = msgspec.json.Decoder(DetokenizeRequest)


class TokenizeRoute(PostRoute):
    speech_ok = True

    async def _work(self, body: bytes, xid: str | None, send: Send) -> None:
        req, renderer, limits = self.state.decode_for_render(_tokenize_decoder, body)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("Send exactly one of prompt (a string) or messages (a chat).", "prompt")
        if req.messages is not None:
            ids, _ = await chat_ids_with_images(self.state, renderer, req, bool(req.add_special_tokens))
        else:
            special = True if req.add_special_tokens is None else req.add_special_tokens
            ids = await text_prompt_ids(renderer, req.prompt or "", special)
        out: dict[str, Any] = {"count": len(ids), "max_model_len": limits.max_model_len, "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = [renderer.tokenizer.id_to_token(i) for i in ids]
        await send_json(send, 200, encoder.encode(out))


class DetokenizeRoute(PostRoute):
    speech_ok = True

    async def _work(self, body: bytes, xid: str | None, send: Send) -> None:
        req, renderer, limits = self.state.decode_for_render(_detokenize_decoder, body)
        check_prompt_ids(req.tokens, limits.vocab_size, "tokens")
        with render_errors("tokens"):
            text = await renderer.decode(req.tokens, skip_special_tokens=False)
        await send_json(send, 200, encoder.encode({"prompt": text}))
