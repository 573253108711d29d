"""Chat templates in a Jinja2 sandbox, rendered as Hugging Face's `apply_chat_template(tokenize=False)` does.

Pure and synchronous: it runs inside the render worker process (server/render/render_worker.py), whose
kill-on-timeout and memory cap are the hard limits; the checks here only make common abuse fail fast
with a clear message.
"""

from __future__ import annotations

import functools
import json
import re
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Largest str/list a template may build with `*` (the worker's memory cap stops other routes to huge values).
MAX_REPEAT_LEN = 1 << 24
# Largest exponent `**` may take: big-int powers run in one C call that only a kill would stop.
MAX_POW_EXPONENT = 1024
# Names HF apply_chat_template passes itself; chat_template_kwargs must not replace them.
RESERVED_KWARGS = frozenset({"messages", "tools", "documents", "add_generation_prompt", "continue_final_message"})
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # the same marker transformers uses
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_ADDRESS = re.compile(r"<[^<>]*? at 0x[0-9a-fA-F]+>")
_MAX_ERROR_CHARS = 600


class TemplateRenderError(ValueError):
    """A template or its inputs cannot be rendered; the message is safe to show to the client."""


class _SpindleSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**"})

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        # Jinja renders a blocked attribute as empty text; an escape attempt should fail loudly instead.
        raise TemplateRenderError(
            f"chat template tried an unsafe operation: attribute {attribute!r} of a {type(obj).__name__!r} "
            "value is off limits"
        )

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(count, int) and len(seq) * count > MAX_REPEAT_LEN:
                    raise TemplateRenderError(
                        f"chat template tried to build a value of {len(seq) * count} items with '*'; "
                        f"the limit is {MAX_REPEAT_LEN}"
                    )
        elif isinstance(right, int) and abs(right) > MAX_POW_EXPONENT and isinstance(left, int) and abs(left) > 1:
            raise TemplateRenderError(f"chat template used an exponent over {MAX_POW_EXPONENT} with '**'")
        return super().call_binop(context, operator, left, right)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (HF's assistant-mask marker) renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise TemplateRenderError(f"chat template error: {message}")


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # HF's tojson: no HTML escaping, and the json.dumps options templates use.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    # HF's restricted `dict`: callable and fromkeys, no attribute access to the type itself.
    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    # HF's namespace: underscore-prefixed names could reach CPython internals, so they are refused.
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise TemplateRenderError("chat templates cannot store underscore-prefixed names on a namespace")


def _environment() -> _SpindleSandbox:
    env = _SpindleSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


_ENV = _environment()


def safe_message(exc: BaseException) -> str:
    """The exception's text with object reprs (`<... at 0x...>`) blanked and its length capped."""
    text = _ADDRESS.sub("<object>", str(exc))
    return text if len(text) <= _MAX_ERROR_CHARS else text[:_MAX_ERROR_CHARS] + "..."


@functools.lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    """Compile once per template string; a syntax error says where."""
    try:
        return _ENV.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise TemplateRenderError(f"chat template syntax error at line {e.lineno}: {safe_message(e)}") from None


def _alias_reasoning(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # As transformers does: fill `reasoning_content` (and `thinking`) from whichever reasoning name is present.
    out = []
    for m in messages:
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        out.append({"thinking": reasoning, **m, "reasoning_content": reasoning} if reasoning is not None else m)
    return out


def render(
    source: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool,
    continue_final_message: bool,
    tools: list[Any] | None,
    documents: list[Any] | None,
    kwargs: dict[str, Any],
    max_output_chars: int,
) -> str:
    """Render like transformers' render_jinja_template; inputs must be plain JSON values (dict/list/str/...)."""
    template = compile_template(source)
    messages = _alias_reasoning([dict(m) for m in messages])
    final: Any = ""
    if continue_final_message:
        final = messages[-1].get("content") if messages else None
        if not isinstance(final, str):
            raise TemplateRenderError("continue_final_message needs a final message with text content to continue")
        if "content" not in source:
            raise TemplateRenderError("continue_final_message is set but the chat template never reads 'content'")
        messages[-1]["content"] = final + _CONTINUE_TAG
    try:
        text = template.render(
            messages=messages, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt, **kwargs
        )
    except TemplateRenderError:
        raise
    except MemoryError:
        raise TemplateRenderError("chat template rendering ran out of its memory limit") from None
    except RecursionError:
        raise TemplateRenderError("chat template recursed too deeply") from None
    except jinja2.exceptions.SecurityError as e:
        raise TemplateRenderError(f"chat template tried an unsafe operation: {safe_message(e)}") from None
    except Exception as e:  # noqa: BLE001 - any template failure is the template's (or its inputs') fault
        raise TemplateRenderError(f"chat template failed: {type(e).__name__}: {safe_message(e)}") from None
    if len(text) > max_output_chars:
        raise TemplateRenderError(f"rendered chat is {len(text)} characters; the limit is {max_output_chars}")
    if continue_final_message:
        tag = _CONTINUE_TAG.strip()
        if final.strip() not in text or tag not in text:
            raise TemplateRenderError(
                "continue_final_message is set but the chat template drops part of the final message; "
                "send it without continue_final_message"
            )
        loc = text.rindex(tag)
        # The template kept the tag's trailing space: cut exactly; else it trimmed whitespace, so trim too.
        text = text[:loc] if text[loc : loc + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:loc].rstrip()
    return text
