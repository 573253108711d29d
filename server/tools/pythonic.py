"""Pythonic tool calls (Llama 3.2 / 4 and others): the output is a Python list of calls, `[f(a=1), g(b="x")]`,
keyword arguments with literal values, optionally inside `<|python_start|>` / `<|python_end|>`; an output that
does not open with `[name(` is content. A string argument streams as it is written; other values once whole.
JSON's true / false / null are read as Python's True / False / None.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from typing import Any

from engine.messages import StructuredOutputs
from server.tools.grammar import ParamRef, function_rules, lark_json, ordered_params
from server.tools.prefix import WS, PrefixParser, Reading, dumps, string_part
from server.tools.scan import skip_ws

START, END = "<|python_start|>", "<|python_end|>"
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_JSON_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


class _Bad(Exception):
    """Not a literal."""


def literal(node: ast.expr) -> Any:
    """A literal's value: constants, lists, tuples, dicts, negatives, and JSON's names."""
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, (str, int, float, bool))
        or (isinstance(node, ast.Constant) and node.value is None)
    ):
        return node.value
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [literal(e) for e in node.elts]
    if isinstance(node, ast.Dict) and all(k is not None for k in node.keys):
        return {str(literal(k)): literal(v) for k, v in zip(node.keys, node.values) if k is not None}
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = literal(node.operand)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    raise _Bad


def _value_end(text: str, i: int) -> int | None:
    """The end of the (non-string-led) value at text[i]: the `,` or `)` at depth 0 after it, or None."""
    depth, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in "\"'":
            end = _string_end(text, i)
            if end is None:
                return None
            i = end
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            if depth == 0:
                return i
            depth -= 1
        elif c == "," and depth == 0:
            return i
        i += 1
    return None


def _string_end(text: str, i: int) -> int | None:
    quote, i, n = text[i], i + 1, len(text)
    while i < n:
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == quote:
            return i + 1
        i += 1
    return None


def _partial_string(raw: str, quote: str) -> str:
    """The value of an unfinished string literal as far as it is certain (a trailing escape held back)."""
    for cut in range(len(raw), max(len(raw) - 12, -1), -1):
        try:
            value = ast.literal_eval(quote + raw[:cut] + quote)
        except (SyntaxError, ValueError):
            continue
        return str(value)
    return ""


def _arguments(text: str, i: int) -> tuple[str, int | None]:
    """The arguments JSON so far of the call whose `(` ends at i, and the index after its `)` (None: unfinished
    or broken)."""
    parts: list[str] = []

    def so_far(extra: str = "") -> str:
        return "{" + ", ".join([*parts, extra] if extra else parts)

    while True:
        i = skip_ws(text, i)
        if i < len(text) and text[i] == ")":
            return so_far() + "}", i + 1
        if parts:
            if i >= len(text) or text[i] != ",":
                return so_far(), None
            i = skip_ws(text, i + 1)
            if i < len(text) and text[i] == ")":
                return so_far() + "}", i + 1
        key = _KEY.match(text, i)
        if key is None or key.end() >= len(text):
            return so_far(), None
        j = skip_ws(text, key.end())
        if j >= len(text) or text[j] != "=":
            return so_far(), None
        j = skip_ws(text, j + 1)
        if j >= len(text):
            return so_far(), None
        if text[j] in "\"'" and not text.startswith(text[j] * 3, j):
            end = _string_end(text, j)
            if end is None:
                return so_far(string_part(key.group(), _partial_string(text[j + 1 :], text[j]))), None
        else:
            end = _value_end(text, j)
            if end is None:
                return so_far(), None
        try:
            value = literal(ast.parse(text[j:end].strip(WS), mode="eval").body)
        except (SyntaxError, ValueError, _Bad):
            return so_far(), None
        parts.append(f"{dumps(key.group())}: {dumps(value)}")
        i = end


def _calls(text: str, i: int, final: bool) -> list[tuple[str, str]] | None:
    """The calls of the list at text[i] == '['; None: not a call list (or not known yet, unless final)."""
    calls: list[tuple[str, str]] = []
    i = skip_ws(text, i + 1)
    while True:
        name = _NAME.match(text, i)
        if name is None or name.end() >= len(text) or text[name.end()] != "(":
            undecided = name is not None and name.end() >= len(text) or i >= len(text)
            return calls if calls or (undecided and not final) else None
        args, end = _arguments(text, name.end() + 1)
        calls.append((name.group(), args))
        if end is None:
            return calls
        i = skip_ws(text, end)
        if i >= len(text) or text[i] != ",":
            return calls
        i = skip_ws(text, i + 1)


class PythonicParser(PrefixParser):
    name = "pythonic"
    markers = ("[func_name1(", "python_start", "[func_name(")

    def read(self, text: str, final: bool) -> Reading:
        start = len(START) if text.startswith(START) else 0
        i = skip_ws(text, start)
        if i >= len(text) or (not start and START.startswith(text[i:]) and not final):
            return Reading(text if final else "")
        if text[i] != "[":
            return Reading(text)
        calls = _calls(text, i, final)
        if calls is None:
            return Reading(text)
        return Reading("", calls)

    @classmethod
    def constraint(
        cls, functions: dict[str, dict[str, Any]], multiple: bool, token_id: Callable[[str], int | None]
    ) -> StructuredOutputs:
        start = 'start: "[" fn ("," " " fn)* "]"' if multiple else 'start: "[" fn "]"'
        return StructuredOutputs("grammar", f"{start}\n" + function_rules(functions, _value_rule, _call_rule))


def _value_rule(schema: Any) -> str:
    """A keyword argument's value as Python writes it: a boolean True / False; else its JSON."""
    boolean = isinstance(schema, dict) and schema.get("type") == "boolean" and "enum" not in schema
    return '"True" | "False"' if boolean else lark_json(schema if isinstance(schema, dict) else {})


def _call_rule(name: str, params: dict[str, Any], refs: list[ParamRef]) -> str:
    kvs = [f"{json.dumps(key + '=')} {ref}" for key, ref in refs]
    return " ".join(x for x in (json.dumps(name + "("), _kwargs(kvs, params), '")"') if x)


def _kwargs(kvs: list[str], params: dict[str, Any]) -> str:
    """The keyword arguments in order: the required ones, then each optional one or not."""
    required = set(params.get("required") or ())
    keys = [k for k, _ in ordered_params(params)]
    need = [kv for k, kv in zip(keys, kvs) if k in required]
    opt = [kv for k, kv in zip(keys, kvs) if k not in required]
    if need:
        return "(" + ' ", " '.join(need) + "".join(f' (", " {kv})?' for kv in opt) + ")"
    if not opt:
        return ""
    nested = ""
    for kv in reversed(opt[1:]):
        nested = f' (", " {kv}{nested})?'
    return f"({opt[0]}{nested})?"
