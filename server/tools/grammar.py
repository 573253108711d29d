"""Pieces of the Lark grammars (llguidance's dialect) that make the engine write a valid tool call."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

# Compact JSON in the separators the Qwen / Hermes templates use: a model (a random one above all) can
# otherwise loop on legal whitespace and never close the call.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def call_schema(name: str, params: dict[str, Any], args_key: str = "arguments") -> dict[str, Any]:
    """One call as a JSON object: the name first (the streaming parsers send it before the arguments)."""
    return {
        "type": "object",
        "properties": {"name": {"const": name}, args_key: params},
        "required": ["name", args_key],
        "additionalProperties": False,
    }


def with_style(schema: dict[str, Any], style: dict[str, Any]) -> dict[str, Any]:
    """The schema with `style` in its x-guidance, over the options it carries (a best-effort schema's lenient)."""
    options = schema.get("x-guidance")
    return {**schema, "x-guidance": {**(options if isinstance(options, dict) else {}), **style}}


def lark_json(schema: dict[str, Any]) -> str:
    return "%json " + json.dumps(with_style(schema, JSON_STYLE))


def lark_tag(text: str, token_id: Callable[[str], int | None]) -> str:
    """A tag as its token (by id: only that token matches) or, when it is not one token, as text."""
    tid = token_id(text)
    return f"<[{tid}]>" if tid is not None else json.dumps(text)


def lark_calls(
    functions: dict[str, dict[str, Any]],
    *,
    open_tag: str,
    close_tag: str,
    sep: str,
    multiple: bool,
    args_key: str = "arguments",
) -> str:
    """start: one call (or several, separated by `sep`) of `open_tag` + JSON call object + `close_tag`."""
    alts = "\n".join(
        f"obj_{i}: {lark_json(call_schema(name, params, args_key))}"
        for i, (name, params) in enumerate(functions.items())
    )
    objs = " | ".join(f"obj_{i}" for i in range(len(functions)))
    start = f"start: call ({json.dumps(sep)} call)*" if multiple else "start: call"
    return f"{start}\ncall: {open_tag} obj {close_tag}\nobj: {objs}\n{alts}\n"


def ordered_params(params: dict[str, Any]) -> list[tuple[str, Any]]:
    """A function's parameters as (name, schema) in the schema's order (none: a free-form object)."""
    props = params.get("properties")
    return list(props.items()) if isinstance(props, dict) else []


ParamRef = tuple[str, str]  # a parameter's name and its value's rule


def function_rules(
    functions: dict[str, dict[str, Any]],
    value: Callable[[Any], str],
    body: Callable[[str, dict[str, Any], list[ParamRef]], str],
) -> str:
    """The grammar's `fn` rule and one `fn_F` rule per function for call formats that spell each parameter apart:
    `v_F_P: value(schema)` per parameter, and the function's `body(name, params, [(key, "v_F_P"), ...])`."""
    rules: list[str] = []
    for f, (name, params) in enumerate(functions.items()):
        refs = []
        for p, (key, schema) in enumerate(ordered_params(params)):
            rules.append(f"v_{f}_{p}: {value(schema)}")
            refs.append((key, f"v_{f}_{p}"))
        rules.append(f"fn_{f}: {body(name, params, refs)}")
    fns = " | ".join(f"fn_{f}" for f in range(len(functions)))
    return f"fn: {fns}\n" + "\n".join(rules) + "\n"
