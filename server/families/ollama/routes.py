"""POST /api/chat and POST /api/generate: Ollama's generation routes over the chat and completions paths (the same
checks, admission, renderer, engine request and output processor as /v1/chat/completions and /v1/completions),
answered by OllamaFormatter. Every error, as a body or as a stream's last line, is `{"error": "..."}`."""

from __future__ import annotations

from server.app_state import AppState
from server.families.ollama import FAMILY
from server.families.ollama.context import checked_context, continued
from server.families.ollama.formatter import FRAMING, OllamaFormatter, created_at
from server.families.ollama.keep_alive import note_keep_alive, unloads
from server.families.ollama.protocol import chat_decoder, encoder, generate_decoder
from server.families.ollama.translate import chat_request, decode_error, generate_chat, generate_text
from server.families.openai.completions import suffix_prompt_ids
from server.http.asgi import Receive, Scope, Send, header, read_body, send_json, serve_post
from server.multimodal.images import image_support
from server.render.renderer import Renderer
from server.request.admission import AdmissionTicket
from server.request.async_llm import AsyncLLM
from server.request.formatter import Formatter
from server.request.input_processor import GenerationSpec, ModelLimits, build_spec, check_request, external_request_id
from server.request.openai_protocol import ChatCompletionRequest, CompletionRequest
from server.request.post_route import PostRoute
from server.request.prompt_tokens import admit_prompts, chat_prompt, fit_limits, render_errors, text_prompt_ids
from server.structured.chat_plan import plan_chat, respond_checked
from server.structured.constraint import structured_outputs
from server.structured.output_check import OutputCheck, relaxed_check
from server.structured.parsing import ChoiceParser


class OllamaRoute(PostRoute):
    """PostRoute's front (body limit, disconnect, runner) with Ollama's errors; any Content-Type, as Ollama."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        xid = header(scope, b"x-request-id")
        limit = self.state.config.http.max_request_body

        async def work(body: bytes) -> None:
            self.check_runner(str(scope.get("path", "")))
            await self._work(body, xid, send)

        await serve_post(receive, send, lambda: read_body(receive, limit), work, FAMILY.errors.send)


def takes_images(state: AppState) -> bool:
    model = state.config.model
    return model.model is not None and image_support(model.model_path) is not None


async def _loaded(send: Send, model: str, chat: bool, unload: bool) -> None:
    """Ollama's answer to a request with nothing to generate: the model is loaded (or, keep_alive 0, unloaded)."""
    answer = {"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}
    reason = "unload" if unload else "load"
    body = {"model": model, "created_at": created_at(), **answer, "done": True, "done_reason": reason}
    await send_json(send, 200, encoder.encode(body))


Parts = tuple[AsyncLLM, Renderer, ModelLimits]


class ChatRoute(OllamaRoute):
    runner = "generate"

    async def _work(self, body: bytes, xid: str | None, send: Send) -> None:
        req, llm, renderer, limits = self.state.decode_for_model(chat_decoder, body, decode_error)
        note_keep_alive(self.state, req.keep_alive)
        if not req.messages:
            await _loaded(send, self.state.shown_model(req.model), True, unloads(req.keep_alive))
            return
        chat = chat_request(req, limits, images=takes_images(self.state))
        await answer_chat(self.state, (llm, renderer, limits), chat, xid, send, chat_shape=True)


class GenerateRoute(OllamaRoute):
    runner = "generate"

    async def _work(self, body: bytes, xid: str | None, send: Send) -> None:
        req, llm, renderer, limits = self.state.decode_for_model(generate_decoder, body, decode_error)
        note_keep_alive(self.state, req.keep_alive)
        if not req.prompt and not req.suffix:
            await _loaded(send, self.state.shown_model(req.model), False, unloads(req.keep_alive))
            return
        context = checked_context(req.context, req.raw, limits)
        if req.raw or req.suffix:
            text = generate_text(req, limits)
            await answer_text(self.state, (llm, renderer, limits), text, xid, send, context, give_context=not req.raw)
            return
        chat = generate_chat(req, limits, images=takes_images(self.state))
        await answer_chat(self.state, (llm, renderer, limits), chat, xid, send, chat_shape=False, context=context)


async def answer_chat(
    state: AppState,
    parts: Parts,
    chat: ChatCompletionRequest,
    xid: str | None,
    send: Send,
    *,
    chat_shape: bool,
    context: list[int] | None = None,
) -> None:
    """The chat path (as /v1/chat/completions and /v1/messages take it), answered in Ollama's shape. /api/generate
    (not `chat_shape`): the prompt continues `context`, and the answer ends with the new one."""
    llm, renderer, limits = parts
    plan = await plan_chat(chat, state.config, renderer.tokenizer, limits, "tools")
    external = external_request_id(xid, None)
    with llm.admit(1, 1) as ticket:  # the request's one ticket: a 503 now when the queue is surely full
        text, ids, mm_inputs = await chat_prompt(state, llm, renderer, chat, ticket, fit_limits(chat, limits))
        spec = plan.spec(chat, continued(context, ids, renderer.tokenizer), limits, external, text, mm_inputs)
        parser = plan.parser(text)
        fmt = _formatter(state, chat.model, spec, parser, chat_shape=chat_shape, give_context=not chat_shape)
        check = plan.check(llm.metrics, text)
        await _respond(llm, spec, fmt, check, send, chat, external, ticket)


async def answer_text(
    state: AppState,
    parts: Parts,
    req: CompletionRequest,
    xid: str | None,
    send: Send,
    context: list[int] | None = None,
    *,
    give_context: bool = False,
) -> None:
    """The completions path (a raw prompt, or fill-in-the-middle with `suffix`), answered in Ollama's shape; the
    prompt continues `context`, and with `give_context` the answer ends with the new one."""
    llm, renderer, limits = parts
    check_request(req, limits)
    constraint = await structured_outputs(req, limits.caps, tokenizer=renderer.tokenizer)
    external = external_request_id(xid, None)
    prompt = req.prompt if isinstance(req.prompt, str) else ""
    with await admit_prompts(llm, 1, [prompt], renderer.tokenizer) as ticket:
        with render_errors("prompt"):
            if req.suffix is not None:
                ids = await suffix_prompt_ids(renderer, prompt, req.suffix)
            else:
                ids = await text_prompt_ids(renderer, prompt, req.add_special_tokens, limits=fit_limits(req, limits))
        so = constraint.so if constraint is not None else None
        ids = continued(context, ids, renderer.tokenizer)
        spec = build_spec(req, ids, limits, external_id=external, stream=req.stream, structured_outputs=so)
        fmt = _formatter(state, req.model, spec, None, chat_shape=False, give_context=give_context)
        check = relaxed_check(llm.metrics, constraint, {})
        await _respond(llm, spec, fmt, check, send, req, external, ticket)


def _formatter(
    state: AppState,
    model: str | None,
    spec: GenerationSpec,
    parser: ChoiceParser | None,
    *,
    chat_shape: bool,
    give_context: bool,
) -> OllamaFormatter:
    """The request's formatter: the model's load time when it is the first since a load, the context's ids."""
    prompt = spec.prompt_token_ids
    return OllamaFormatter(
        state.shown_model(model),
        len(prompt),
        parser,
        chat=chat_shape,
        load_ns=state.take_load_ns(),
        context=prompt if give_context else None,
    )


async def _respond(
    llm: AsyncLLM,
    spec: GenerationSpec,
    fmt: Formatter,
    check: OutputCheck | None,
    send: Send,
    req: ChatCompletionRequest | CompletionRequest,
    external: str,
    ticket: AdmissionTicket,
) -> None:
    """The answer in Ollama's framing, its id in X-Request-ID."""
    headers = [(b"x-request-id", external.encode())]
    await respond_checked(llm, [spec], fmt, check, send, req, headers, ticket, framing=FRAMING)
