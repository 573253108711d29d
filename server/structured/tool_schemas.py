"""Tool parameters the engine enforces as far as it can: a function without `strict: true` (OpenAI's
`function.strict`, Anthropic's tool `strict`) gets best effort, as a non-strict response_format does
(engine/structured/relaxed_schema.py); a strict one is enforced whole or refused with a 400.

Only a tool choice that constrains the output (required, a named function) compiles the parameters; the
relaxed functions' full schemas go to server/structured/output_check.py, which validates the calls' arguments.
"""

from __future__ import annotations

from typing import Any

from server.config import RequestCaps
from server.structured.constraint import Relaxation, relax_schema
from server.tools.grammar import JSON_STYLE


async def relax_tools(
    tools: list[dict[str, Any]], caps: RequestCaps, param: str = "tools"
) -> tuple[list[dict[str, Any]], dict[str, Relaxation]]:
    """The tools with each non-strict function's parameters as the backend can enforce them, and what was relaxed
    per function name. Malformed tools are left as they are (server/tools/choice.py answers them with its 400)."""
    out: list[dict[str, Any]] = []
    relaxed: dict[str, Relaxation] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        params = fn.get("parameters") if isinstance(fn, dict) else None
        if not isinstance(fn, dict) or fn.get("strict") is True or not isinstance(params, dict):
            out.append(tool)
            continue
        schema, keywords = await relax_schema(params, f"{param}[{i}].function.parameters", caps, JSON_STYLE)
        if keywords:
            relaxed[str(fn.get("name"))] = Relaxation(keywords, params)
            tool = {**tool, "function": {**fn, "parameters": schema}}
        out.append(tool)
    return out, relaxed
