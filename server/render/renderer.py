"""Chat rendering and tokenization off the event loop: a sandboxed, time- and memory-capped worker pool.

Templates render in worker processes (server/render/render_worker.py via server/render/worker_pool.py) because a
runaway template must stop burning CPU, which only a kill guarantees; tokenization goes to the same
workers because HF tokenizers hold the GIL for a whole `encode` (a long prompt stalls even a thread-
based event loop: bench/README.md, "Long prompts tokenize in a worker process"). The tokenizer is also
loaded here for the detokenizer.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import msgspec
import tokenizers

from server.render import template_sandbox
from server.render.template_sandbox import RESERVED_KWARGS
from server.render.worker_pool import PoolOverloaded, WorkerCrashed, WorkerPool, WorkerTimeout, WorkerUserError

# The named special tokens HF passes to every template (its SPECIAL_TOKENS_ATTRIBUTES).
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
DEFAULT_MEMORY_LIMIT = 1 << 30  # bytes a worker may allocate beyond its tokenizer
DEFAULT_MAX_OUTPUT_CHARS = 32 << 20
DEFAULT_TOKENIZE_TIMEOUT = 30.0  # seconds a worker may (de)tokenize one input; a prompt that fits a context needs < 1 s
# Texts (chars) / id lists up to this size are (de)tokenized on the event loop: far cheaper than a worker
# round trip, and too short to stall the loop (bench/README.md, "Inline (de)tokenization").
DEFAULT_INLINE_MAX = 512


class RenderError(ValueError):
    """The request's chat cannot be rendered; a 400 whose message says what to fix."""


class RendererOverloaded(RuntimeError):
    """Too many requests are waiting for the renderer's workers; a 503."""


def load_chat_template(chat_template: str | None, tokenizer_dir: Path) -> str | None:
    """--chat-template (a file or a literal template), else the checkpoint's chat_template.jinja or config entry."""
    if chat_template is not None:
        path = Path(chat_template)
        try:
            if path.is_file():
                return path.read_text()
        except OSError:  # e.g. a literal template too long to be a file name
            pass
        if any(c in chat_template for c in "{}\n"):
            return chat_template
        raise ValueError(f"--chat-template {chat_template!r} looks like a file path but no such file exists")
    jinja_file = tokenizer_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    config_file = tokenizer_dir / "tokenizer_config.json"
    if not config_file.is_file():
        return None
    template = json.loads(config_file.read_text()).get("chat_template")
    if isinstance(template, list):  # [{name, template}, ...]: HF uses the one named "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def load_special_tokens(tokenizer_dir: Path) -> dict[str, str]:
    """bos_token, eos_token, ... as HF's `special_tokens_map` gives them to templates (unset ones omitted)."""
    found: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the config wins, as in transformers
        file = tokenizer_dir / name
        if not file.is_file():
            continue
        data = json.loads(file.read_text())
        for key in _SPECIAL_TOKEN_NAMES:
            value = data.get(key)
            if isinstance(value, dict):  # a serialized AddedToken
                value = value.get("content")
            if isinstance(value, str):
                found[key] = value
            elif key in data and value is None:
                found.pop(key, None)
    return found


def _text_content(index: int, content: Any) -> Any:
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RenderError(f"messages[{index}].content must be a string or a list of text parts")
    if any(isinstance(p, dict) and p.get("type") == "image" and len(p) == 1 for p in content):
        # a vision model's request (server/multimodal/images.py put the markers): the template renders the parts
        if all(
            isinstance(p, dict)
            and (p == {"type": "image"} or (p.get("type") == "text" and isinstance(p.get("text"), str)))
            for p in content
        ):
            return content
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise RenderError(
                f"messages[{index}].content has a part of type {kind!r}; this server accepts only "
                '{"type": "text", "text": "..."} parts'
            )
        texts.append(part["text"])
    return "\n".join(texts)


def normalize_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """Plain dicts with string content; keys set to None dropped (as transformers does)."""
    if not messages:
        raise RenderError("messages must hold at least one message")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RenderError(f"messages[{i}] must be an object with a string 'role'")
        plain = {k: v for k, v in message.items() if v is not None}
        content = _text_content(i, message.get("content"))
        if content is not None:
            plain["content"] = content
        if isinstance(plain.get("tool_calls"), list):
            plain["tool_calls"] = _tool_calls(i, plain["tool_calls"])
        out.append(plain)
    return out


def _tool_calls(index: int, calls: list[Any]) -> list[Any]:
    """Assistant tool calls for the template: `function.arguments` arrives as JSON text (OpenAI's wire format)
    and reaches the template as an object, as transformers' templates expect (they `tojson` it)."""
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                args = json.loads(fn["arguments"]) if fn["arguments"].strip() else {}
            except ValueError:
                raise RenderError(
                    f"messages[{index}].tool_calls[{j}].function.arguments is not valid JSON; "
                    "send the arguments as the JSON text the model produced"
                ) from None
            call = {**call, "function": {**fn, "arguments": args}}
        out.append(call)
    return out


def _plain(value: Any, what: str) -> Any:
    try:
        return msgspec.to_builtins(value)  # Structs -> dicts; anything exotic is refused
    except (TypeError, ValueError):
        raise RenderError(f"{what} must be plain JSON values") from None


class Renderer:
    tokenizer: tokenizers.Tokenizer
    has_chat_template: bool

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        pool: WorkerPool,
        chat_template: str | None,
        template_kwargs: dict[str, Any],
        render_timeout: float,
        trust_request_chat_template: bool,
        inline_max: int = DEFAULT_INLINE_MAX,
        tokenize_timeout: float = DEFAULT_TOKENIZE_TIMEOUT,
    ) -> None:
        self.tokenizer = tokenizer
        self.has_chat_template = chat_template is not None
        self._pool = pool
        self._template_kwargs = template_kwargs
        self._render_timeout = render_timeout
        self._trust_request_chat_template = trust_request_chat_template
        self._inline_max = inline_max
        self._tokenize_timeout = tokenize_timeout

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        model_dir: str | Path,
        *,
        tokenizer_dir: str | Path | None = None,
        chat_template: str | None = None,
        num_workers: int = 1,
        render_timeout: float = 5.0,
        default_chat_template_kwargs: dict[str, Any] | None = None,
        trust_request_chat_template: bool = False,
        max_waiting: int = 256,
        memory_limit: int = DEFAULT_MEMORY_LIMIT,
        max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS,
        inline_max: int = DEFAULT_INLINE_MAX,
        tokenize_timeout: float = DEFAULT_TOKENIZE_TIMEOUT,
    ) -> AsyncIterator[Renderer]:
        """Load the tokenizer and template, start `num_workers` workers; stop them on exit."""
        tok_dir = Path(tokenizer_dir if tokenizer_dir is not None else model_dir)
        tok_file = tok_dir / "tokenizer.json"
        if not tok_file.is_file():
            raise ValueError(f"no tokenizer.json in {tok_dir}; pass --tokenizer with a folder that holds one")
        template = load_chat_template(chat_template, tok_dir)
        if clash := sorted(RESERVED_KWARGS & (default_chat_template_kwargs or {}).keys()):
            raise ValueError(f"default chat template kwargs cannot set {', '.join(clash)}")
        kwargs = {**load_special_tokens(tok_dir), **(default_chat_template_kwargs or {})}
        tokenizer = await anyio.to_thread.run_sync(tokenizers.Tokenizer.from_file, str(tok_file))
        config = {
            "tokenizer_file": str(tok_file),
            "default_template": template,
            "memory_limit": memory_limit,
            "max_output_chars": max_output_chars,
        }
        if template is not None:  # a broken --chat-template fails startup, not every request
            try:
                template_sandbox.compile_template(template)
            except template_sandbox.TemplateRenderError as e:
                raise ValueError(f"the chat template does not compile: {e}") from None
        async with WorkerPool.open(num_workers, config, max_waiting=max_waiting) as pool:
            yield cls(
                tokenizer,
                pool,
                template,
                kwargs,
                render_timeout,
                trust_request_chat_template,
                inline_max,
                tokenize_timeout,
            )

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the live workers (for tests and diagnostics)."""
        return self._pool.pids

    async def _call(self, request: list[Any], timeout: float | None) -> Any:
        try:
            return await self._pool.call(request, timeout)
        except WorkerUserError as e:
            raise RenderError(str(e)) from None
        except PoolOverloaded as e:
            raise RendererOverloaded(f"the server is overloaded ({e}); retry later") from None

    async def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[Any] | None = None,
        documents: list[Any] | None = None,
    ) -> str:
        """The prompt text for `messages`, as transformers' apply_chat_template(tokenize=False) renders it."""
        if chat_template is not None and not self._trust_request_chat_template:
            raise RenderError(
                "this server does not accept a chat_template in requests; drop it, or start the server "
                "with --trust-request-chat-template"
            )
        if chat_template is None and not self.has_chat_template:
            raise RenderError(
                "the model has no chat template; start the server with --chat-template FILE, "
                "or send a plain prompt to /v1/completions"
            )
        if add_generation_prompt and continue_final_message:
            raise RenderError(
                "add_generation_prompt and continue_final_message cannot both be true: set add_generation_prompt "
                "to false to continue the final assistant message"
            )
        extra = _plain(chat_template_kwargs or {}, "chat_template_kwargs")
        if not isinstance(extra, dict):
            raise RenderError("chat_template_kwargs must be an object")
        if clash := sorted(RESERVED_KWARGS & extra.keys()):
            raise RenderError(f"chat_template_kwargs cannot set {', '.join(clash)}; use the request fields instead")
        args = {
            "source": chat_template,
            "messages": normalize_messages(_plain(messages, "messages")),
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
            "tools": _plain(tools, "tools"),
            "documents": _plain(documents, "documents"),
            "kwargs": {**self._template_kwargs, **extra},
        }
        try:
            result: str = await self._call(["render", args], self._render_timeout)
        except WorkerTimeout:
            raise RenderError(
                f"rendering the chat template took longer than {self._render_timeout} s and was stopped; "
                "shorten the messages or simplify the template"
            ) from None
        except WorkerCrashed:
            raise RenderError("rendering the chat template crashed the renderer (likely its memory limit)") from None
        return result

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`: short texts here, others in a worker process (encode holds the GIL throughout)."""
        if len(text) <= self._inline_max:
            try:
                return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)
            except (TypeError, ValueError) as e:
                raise RenderError(f"cannot encode: {e}") from None
        ids: list[int] = await self._tokenize(["encode", text, add_special_tokens], "tokenizing the text")
        return ids

    async def encode_pair(self, text: str, pair: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text pair as the tokenizer joins them (a cross-encoder's query and document: its pair
        template, e.g. [CLS] a [SEP] b [SEP]; or the two texts one after the other). An empty `pair` is no pair,
        as transformers' tokenizer(text, "") has it."""
        if not pair:
            return await self.encode(text, add_special_tokens)
        if len(text) + len(pair) <= self._inline_max:
            try:
                return list(self.tokenizer.encode(text, pair, add_special_tokens=add_special_tokens).ids)
            except (TypeError, ValueError) as e:
                raise RenderError(f"cannot encode: {e}") from None
        ids: list[int] = await self._tokenize(["encode_pair", text, pair, add_special_tokens], "tokenizing the texts")
        return ids

    async def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`: short lists here, others in a worker process."""
        if len(ids) <= self._inline_max:
            try:
                return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))
            except (TypeError, ValueError, OverflowError) as e:  # e.g. a negative id
                raise RenderError(f"cannot decode: {e}") from None
        text: str = await self._tokenize(["decode", list(ids), skip_special_tokens], "decoding the token ids")
        return text

    async def _tokenize(self, request: list[Any], what: str) -> Any:
        """A worker (de)tokenization under the same time limit and memory cap as a template render."""
        try:
            return await self._call(request, self._tokenize_timeout)
        except WorkerTimeout:
            raise RenderError(
                f"{what} took longer than {self._tokenize_timeout} s and was stopped; send a shorter input"
            ) from None
        except WorkerCrashed:
            raise RenderError(f"{what} crashed the renderer (likely its memory limit); send a shorter input") from None
