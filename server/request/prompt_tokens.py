"""A request's prompt to token ids, as the routes share it: render and tokenize with the renderer's errors as API
errors, refusing early what surely cannot be served: a prompt too long for the model (400) and a request the
queue surely has no room for (503, the admission ticket taken at a lower bound before rendering/tokenizing)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import anyio
import msgspec
import tokenizers

from engine.messages import ImageInput
from server.app_state import AppState
from server.http import unavailable
from server.http.errors import bad_request
from server.multimodal.images import expand_for_model, has_images, prepare_images
from server.render.renderer import Renderer, RendererOverloaded, RenderError
from server.request.admission import AdmissionTicket, min_tokens
from server.request.async_llm import AsyncLLM
from server.request.input_processor import ModelLimits, check_fits, max_token_bytes
from server.request.openai_protocol import ChatCompletionRequest


@contextmanager
def render_errors(param: str) -> Iterator[None]:
    """RenderError -> 400 naming `param`; RendererOverloaded -> 503 with Retry-After."""
    try:
        yield
    except RenderError as e:
        raise bad_request(str(e), param) from None
    except RendererOverloaded as e:
        raise unavailable.unavailable(str(e)) from None


def require_messages(req: Any) -> None:
    if req.messages is None:
        raise bad_request("messages is required: a list of {role, content} objects.", "messages")


async def render_chat(renderer: Renderer, req: Any) -> str:
    """`req.messages` through the chat template, with the request's template options."""
    with render_errors("messages"):
        text: str = await renderer.render_chat(
            req.messages,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            chat_template=req.chat_template,
            chat_template_kwargs=req.chat_template_kwargs,
            tools=req.tools,
            documents=req.documents,
        )
    return text


async def text_prompt_ids(
    renderer: Renderer, text: str, add_special_tokens: bool, param: str = "prompt", limits: ModelLimits | None = None
) -> list[int]:
    """Token ids of `text`; with `limits`, a text that surely cannot fit max_model_len is refused (400) first.

    Pass no `limits` where length is not an error: /tokenize, or a prompt truncate_prompt_tokens will cut.
    """
    if limits is not None:
        check_fits(await prompts_lower_bound(renderer.tokenizer, [text]), limits, param)
    with render_errors(param):
        ids: list[int] = await renderer.encode(text, add_special_tokens)
    return ids


async def chat_prompt_ids(
    renderer: Renderer, req: Any, add_special_tokens: bool, limits: ModelLimits | None = None
) -> list[int]:
    text = await render_chat(renderer, req)
    return await text_prompt_ids(renderer, text, add_special_tokens, "messages", limits)


def fit_limits(req: Any, limits: ModelLimits) -> ModelLimits | None:
    """The limits a prompt must fit before tokenizing: none when truncate_prompt_tokens will cut it."""
    return limits if getattr(req, "truncate_prompt_tokens", None) is None else None


_token_bytes: dict[int, int] = {}  # id(tokenizer) -> max_token_bytes, read without a thread hop


async def prompts_lower_bound(tokenizer: tokenizers.Tokenizer, prompts: list[str | list[int]]) -> int:
    """A lower bound on the tokens of `prompts` without tokenizing them (at least 1 each: empty is refused)."""
    per = 1
    if any(isinstance(p, str) for p in prompts):
        per = _token_bytes.get(id(tokenizer)) or 0
        if not per:  # the vocabulary scan (once per tokenizer) stays off the event loop
            per = _token_bytes[id(tokenizer)] = await anyio.to_thread.run_sync(max_token_bytes, tokenizer)
    return sum(max(1, min_tokens(p, per) if isinstance(p, str) else len(p)) for p in prompts)


async def admit_prompts(
    llm: AsyncLLM,
    n: int,
    prompts: list[str | list[int]],
    tokenizer: tokenizers.Tokenizer,
    ticket: AdmissionTicket | None = None,
) -> AdmissionTicket:
    """The request's admission ticket (or `ticket`, resized) at a lower bound of `prompts`' tokens, `n` engine
    requests each: a 503 before they are tokenized when the queue surely has no room. AsyncLLM.generate settles
    the ticket at the exact count."""
    lower = await prompts_lower_bound(tokenizer, prompts) if llm.admission is not None else len(prompts)
    return llm.admit(n * len(prompts), n * lower, ticket)


async def chat_ids_with_images(
    state: AppState, renderer: Renderer, req: Any, add_special_tokens: bool, limits: ModelLimits | None = None
) -> tuple[list[int], list[ImageInput] | None]:
    """A chat request's prompt ids, each image's placeholder expanded to its tokens, and its images for the
    engine (None without images): the path /tokenize, the render routes and the Anthropic routes share."""
    if not has_images(req.messages):
        return await chat_prompt_ids(renderer, req, add_special_tokens, limits), None
    images, messages = await prepare_images(state, req.messages, getattr(req, "mm_processor_kwargs", None))
    ids = await chat_prompt_ids(renderer, msgspec.structs.replace(req, messages=messages), add_special_tokens, limits)
    return expand_for_model(ids, images, state.config.model.model_path)


async def chat_prompt(
    state: AppState,
    llm: AsyncLLM,
    renderer: Renderer,
    req: ChatCompletionRequest,
    ticket: AdmissionTicket | None,
    fit: ModelLimits | None,
    param: str = "messages",
) -> tuple[str, list[int], list[ImageInput] | None]:
    """A generation route's chat prompt, the one path of the chat, Responses and Anthropic routes: images processed,
    rendered, the admission `ticket` resized to the rendered text's lower bound, tokenized (with `fit`: refused
    first when surely too long), each image's placeholder expanded; its images for the engine (None without)."""
    images, render_req = None, req
    if has_images(req.messages):  # decoded and preprocessed in the image worker process
        images, messages = await prepare_images(state, req.messages or [], req.mm_processor_kwargs)
        render_req = msgspec.structs.replace(req, messages=messages)
    text = await render_chat(renderer, render_req)
    if ticket is not None:
        await admit_prompts(llm, req.n, [text], renderer.tokenizer, ticket)
    ids = await text_prompt_ids(renderer, text, req.add_special_tokens, param, fit)
    if images is None:
        return text, ids, None
    ids, mm_inputs = expand_for_model(ids, images, state.config.model.model_path)  # before any length check
    return text, ids, mm_inputs
