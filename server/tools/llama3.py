"""Llama 3.x JSON tool calls: the output is `{"name": "f", "parameters": {...}}` (or "arguments"), several
separated by `;`, optionally after `<|python_tag|>`; an output that does not open with a JSON object is content.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.messages import StructuredOutputs
from server.tools.grammar import lark_calls
from server.tools.prefix import WS, PrefixParser, Reading
from server.tools.scan import json_string, scan_object, skip_ws

PYTHON_TAG = "<|python_tag|>"
ARGS_KEYS = ("parameters", "arguments")


def _calls(text: str, i: int) -> tuple[list[tuple[str, str]], bool]:
    """The calls from text[i] on (text[i] == '{'), and whether the first object turned out to be no call."""
    calls: list[tuple[str, str]] = []
    while True:
        scan = scan_object(text, i)
        name = next((m for m in scan.members if m.key == "name"), None)
        value = json_string(text[name.start : name.end]) if name is not None and name.end is not None else None
        if value is None:
            return calls, not calls and (scan.error or scan.end is not None)
        args = next((m for m in scan.members if m.key in ARGS_KEYS), None)
        arguments = "" if args is None else text[args.start : args.end if args.end is not None else len(text)]
        calls.append((value, arguments))
        if scan.end is None:
            return calls, False
        j = skip_ws(text, scan.end)
        if j >= len(text) or text[j] != ";":
            return calls, False
        j = skip_ws(text, j + 1)
        if j >= len(text) or text[j] != "{":
            return calls, False
        i = j


class Llama3JsonParser(PrefixParser):
    name = "llama3_json"
    markers = ('"parameters"', PYTHON_TAG)  # in a chat template that teaches this format

    def read(self, text: str, final: bool) -> Reading:
        start = len(PYTHON_TAG) if text.startswith(PYTHON_TAG) else 0
        if not start and PYTHON_TAG.startswith(text.lstrip(WS)) and text.strip(WS) and not final:
            return Reading()  # may be the tag
        i = skip_ws(text, start)
        if i >= len(text):
            return Reading(text[start:] if final else "")
        if text[i] != "{":
            return Reading(text[start:])
        calls, not_a_call = _calls(text, i)
        if not_a_call or (final and not calls):
            return Reading(text[start:])
        return Reading("", calls)

    @classmethod
    def constraint(
        cls, functions: dict[str, dict[str, Any]], multiple: bool, token_id: Callable[[str], int | None]
    ) -> StructuredOutputs:
        return StructuredOutputs(
            "grammar",
            lark_calls(functions, open_tag="", close_tag="", sep="; ", multiple=multiple, args_key="parameters"),
        )
