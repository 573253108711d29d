"""--tool-call-parser names (vLLM's) -> parser classes."""

from __future__ import annotations

from server.tools.llama3 import Llama3JsonParser
from server.tools.parser import HermesParser, MistralParser, ToolParser
from server.tools.pythonic import PythonicParser
from server.tools.qwen3_coder import Qwen3CoderParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "mistral": MistralParser,
    "llama3_json": Llama3JsonParser,
    "pythonic": PythonicParser,
    "qwen3_coder": Qwen3CoderParser,
}


def get_tool_parser(name: str) -> type[ToolParser]:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(TOOL_PARSERS)}") from None


def template_fits(name: str, template: str | None) -> bool:
    """Whether a chat template holds one of the parser's tool-call markers (no template: nothing to say)."""
    if not template:
        return True
    return any(marker in template for marker in get_tool_parser(name).markers)
