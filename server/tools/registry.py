"""--tool-call-parser names (vLLM's) -> parser classes."""

from __future__ import annotations

from server.tools.parser import HermesParser, JsonCallParser, MistralParser

TOOL_PARSERS: dict[str, type[JsonCallParser]] = {"hermes": HermesParser, "mistral": MistralParser}


def get_tool_parser(name: str) -> type[JsonCallParser]:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(TOOL_PARSERS)}") from None
