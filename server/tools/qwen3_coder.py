"""Qwen3-Coder's XML tool calls: `<tool_call>\\n<function=NAME>\\n<parameter=P>\\nvalue\\n</parameter>\\n...
</function>\\n</tool_call>`. A value is text; the function's schema says which parameters are strings (streamed
as written, the one newline after the tag and before the closing tag dropped, as the template writes them) and
which are JSON (numbers, booleans, objects, arrays: read once whole, text when they do not parse).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from typing import Any

from engine.messages import StructuredOutputs
from server.tools.grammar import ParamRef, function_rules, lark_json, lark_tag, ordered_params
from server.tools.prefix import WS, PrefixParser, Reading, dumps, string_part
from server.tools.scan import held, skip_ws

START, END = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAM, PARAM_END = "<parameter=", "</parameter>"
_NOT_STRING = {"integer", "number", "boolean", "object", "array", "null"}


def is_text(schema: Any) -> bool:
    """A parameter written as text (a string, or a schema that names no other type)."""
    types = schema.get("type") if isinstance(schema, dict) else None
    names = set(types) if isinstance(types, list) else {types}
    return not names & _NOT_STRING or "string" in names


def _typed(text: str, schema: Any) -> Any:
    """A whole parameter value: JSON when its schema is not a string's (and it parses), else the text."""
    if is_text(schema):
        return text
    try:
        return json.loads(text)
    except ValueError:
        lowered = text.strip().lower()
        return {"true": True, "false": False, "null": None}.get(lowered, text)


class Qwen3CoderParser(PrefixParser):
    name = "qwen3_coder"
    markers = ("<function=", "<parameter=")

    def __init__(self, functions: dict[str, dict[str, Any]] | None = None) -> None:
        super().__init__()
        self._functions = functions or {}

    @classmethod
    def factory(cls, functions: dict[str, dict[str, Any]]) -> Callable[[], Qwen3CoderParser]:
        return partial(cls, functions)

    def read(self, text: str, final: bool) -> Reading:
        content: list[str] = []
        calls: list[tuple[str, str]] = []
        pos, seen = 0, False
        while True:
            k = text.find(START, pos)
            if k < 0:
                tail = text[pos:]
                if not final:
                    tail = tail[: len(tail) - held(tail, START)].rstrip(WS)
                elif seen:
                    tail = tail.rstrip(WS)
                content.append(tail)
                return Reading("".join(content), calls)
            content.append(text[pos:k].rstrip(WS))
            seen = True
            end = text.find(END, k + len(START))
            body = text[k + len(START) : end if end >= 0 else len(text)]
            found = self._functions_in(body)
            if end < 0:
                if not found and final:
                    content.append(text[k:])
                calls.extend(found)
                return Reading("".join(content), calls)
            if not found:
                content.append(text[k : end + len(END)])
            calls.extend(found)
            pos = end + len(END)

    def _functions_in(self, body: str) -> list[tuple[str, str]]:
        calls: list[tuple[str, str]] = []
        i = 0
        while True:
            i = skip_ws(body, i)
            if not body.startswith(FUNCTION, i):
                return calls
            close = body.find(">", i + len(FUNCTION))
            if close < 0:
                return calls
            name = body[i + len(FUNCTION) : close].strip(WS)
            args, end = self._parameters(body, close + 1, self._functions.get(name) or {})
            calls.append((name, args))
            if end is None:
                return calls
            i = end

    def _parameters(self, body: str, i: int, params: dict[str, Any]) -> tuple[str, int | None]:
        """The arguments JSON so far from body[i] on, and the index after `</function>` (None: not there yet)."""
        props = dict(ordered_params(params))
        parts: list[str] = []
        while True:
            i = skip_ws(body, i)
            if body.startswith(FUNCTION_END, i):
                return "{" + ", ".join(parts) + "}", i + len(FUNCTION_END)
            if not body.startswith(PARAM, i):
                return "{" + ", ".join(parts), None
            close = body.find(">", i + len(PARAM))
            if close < 0:
                return "{" + ", ".join(parts), None
            key = body[i + len(PARAM) : close].strip(WS)
            start = close + 1 + (1 if body.startswith("\n", close + 1) else 0)
            end = body.find(PARAM_END, start)
            schema = props.get(key)
            if end < 0:
                if close + 1 < len(body) and is_text(schema):
                    raw = body[start:]
                    raw = raw[: len(raw) - held(raw, "\n" + PARAM_END)]
                    parts.append(string_part(key, raw))
                return "{" + ", ".join(parts), None
            value = body[start:end]
            value = value[:-1] if value.endswith("\n") else value
            parts.append(f"{dumps(key)}: {dumps(_typed(value, schema))}")
            i = end + len(PARAM_END)

    @classmethod
    def constraint(
        cls, functions: dict[str, dict[str, Any]], multiple: bool, token_id: Callable[[str], int | None]
    ) -> StructuredOutputs:
        call = f'call: {lark_tag(START, token_id)} "\\n" fn "\\n" {lark_tag(END, token_id)}'
        start = 'start: call ("\\n" call)*' if multiple else "start: call"
        return StructuredOutputs("grammar", f"{start}\n{call}\n" + function_rules(functions, _value_rule, _call_rule))


def _call_rule(name: str, params: dict[str, Any], refs: list[ParamRef]) -> str:
    """<function=name> then each parameter as <parameter=key>, its value, </parameter> (an optional one or not)."""
    required = set(params.get("required") or ())
    seq = []
    for key, ref in refs:
        item = f"{json.dumps(PARAM + key + '>' + chr(10))} {ref} {json.dumps(chr(10) + PARAM_END + chr(10))}"
        seq.append(item if key in required else f"({item})?")
    return f"{json.dumps(FUNCTION + name + '>' + chr(10))} {' '.join(seq)} {json.dumps(FUNCTION_END)}"


def _value_rule(schema: Any) -> str:
    """A parameter's value as text: a string's enum or free text without `<` or a newline; else its JSON."""
    schema = schema if isinstance(schema, dict) else {}
    if not is_text(schema):
        return lark_json(schema)
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(e, str) for e in enum):
        return " | ".join(json.dumps(e) for e in enum)
    return r"/[^<\n]+/"
