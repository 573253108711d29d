"""tool_choice -> what a chat request does with its tools: which parser reads the output, and for
"required" / a named function, the constraint that makes the engine write a valid call.

With a --tool-call-parser the constraint is a Lark grammar in that parser's own format (for hermes:
`<tool_call>` `{"name": ..., "arguments": %json{parameters}}` `</tool_call>`, the tags by token id when the
tokenizer has them as tokens), so the model writes what its template taught it and the same parser reads
the call back, streamed or not. Without a parser, vLLM's JSON approach: a named call's output is its
arguments object (kind "json" with the function's parameters), "required" writes a JSON list of
{"name", "parameters"} objects. Either way the arguments validate against the function's `parameters`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.messages import StructuredOutputs
from server.http.errors import APIError
from server.tools.grammar import call_schema, with_style
from server.tools.parser import JsonListParser, NamedArgsParser, ToolParser
from server.tools.parser_names import get_tool_parser

AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


@dataclass(frozen=True)
class ToolPlan:
    """What the chat route does with tools. parser: a factory for one choice's parser (None: no parsing)."""

    mode: str  # "none" | "auto" | "required" | "named"
    parser: Callable[[], ToolParser] | None
    constraint: StructuredOutputs | None = None
    skip_special_tokens: bool = True


def _bad(message: str, param: str = "tool_choice") -> APIError:
    return APIError(message, status=400, param=param)


def _functions(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """name -> the function's parameters schema; a 400 for a malformed tool."""
    found: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise _bad(
                f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., "parameters": ...}}}}', "tools"
            )
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise _bad(f"tools[{i}].function.name must be a non-empty string", "tools")
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise _bad(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        found[name] = params
    return found


def _choice(tool_choice: Any) -> str:
    """'none' | 'auto' | 'required' | the named function's name (prefixed with 'fn:')."""
    if tool_choice in ("none", "auto", "required"):
        return str(tool_choice)
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        if tool_choice.get("type") == "function" and isinstance(fn, dict) and isinstance(fn.get("name"), str):
            return "fn:" + str(fn["name"])
    raise _bad('tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}')


def plan_tools(
    tools: list[dict[str, Any]] | None,
    tool_choice: Any,
    *,
    parser_name: str | None,
    enable_auto: bool,
    token_id: Callable[[str], int | None],
    parallel: bool = True,
) -> ToolPlan | None:
    """The request's ToolPlan (None: no tools involved), or a 400. `token_id`: the tokenizer's id of an
    added token's text, or None when the text is not one token. `parallel` False (OpenAI's
    parallel_tool_calls, Anthropic's disable_parallel_tool_use): "required" writes exactly one call."""
    if tool_choice is None:
        if not tools:
            return None
        # OpenAI's default with tools is "auto"; without --enable-auto-tool-choice the tools are only
        # rendered (vLLM refuses such a request with a 400 instead; an explicit "auto" still gets it here).
        tool_choice = "auto" if enable_auto and parser_name else "none"
    choice = _choice(tool_choice)
    if choice != "none" and not tools:
        raise _bad("When using `tool_choice`, `tools` must be set.")
    functions = _functions(tools or [])
    if choice == "none":
        return ToolPlan("none", None)
    parser_cls = get_tool_parser(parser_name) if parser_name else None
    skip = parser_cls.skip_special_tokens if parser_cls is not None else True
    if choice == "auto":
        if not enable_auto or parser_cls is None:
            raise _bad(AUTO_NEEDS_FLAGS)
        return ToolPlan("auto", parser_cls.factory(functions), None, skip)
    if choice.startswith("fn:"):
        name = choice[3:]
        if name not in functions:
            raise _bad(
                f"The tool specified in `tool_choice` ({name!r}) does not match any of the specified "
                f"`tools` ({', '.join(map(repr, functions))})."
            )
        chosen = {name: functions[name]}
        if parser_cls is None:
            return ToolPlan(
                "named", lambda: NamedArgsParser(name), StructuredOutputs("json", json.dumps(functions[name])), skip
            )
        return ToolPlan("named", parser_cls.factory(chosen), parser_cls.constraint(chosen, False, token_id), skip)
    if parser_cls is None:
        schema = _list_schema(functions, parallel)
        return ToolPlan("required", JsonListParser, StructuredOutputs("json", json.dumps(schema)), skip)
    return ToolPlan(
        "required", parser_cls.factory(functions), parser_cls.constraint(functions, parallel, token_id), skip
    )


def _list_schema(functions: dict[str, dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """vLLM's schema for "required" without a parser: a non-empty list of {"name", "parameters"}."""
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"anyOf": [call_schema(n, p, "parameters") for n, p in functions.items()]},
    }
    if not parallel:
        schema["maxItems"] = 1
    lenient = [p["x-guidance"] for p in functions.values() if isinstance(p.get("x-guidance"), dict)]
    if lenient:  # llguidance reads x-guidance at the root only: a best-effort function's options go up there
        schema = with_style(schema, {k: v for options in lenient for k, v in options.items()})
    return schema
