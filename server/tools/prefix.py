"""Tool-call parsers that re-read the text so far: a pure `read(text, final)` whose answer for a prefix is
extended, never changed, by the answer for any longer text (content appended, calls added, each call's
arguments appended). The deltas are the differences between successive readings, so the calls a client
assembles from a stream equal the non-streamed calls for every way the text was cut.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from server.tools.parser import ParsedDelta, ToolCallDelta, ToolParser, openai_call_id

WS = " \t\n\r"


@dataclass
class Reading:
    content: str = ""
    calls: list[tuple[str, str]] = field(default_factory=list)  # (name, arguments JSON text so far)


class PrefixParser(ToolParser):
    """Streams the differences between `read`'s answers; a call whose arguments never began gets "{}"."""

    def __init__(self) -> None:
        self._text = ""
        self._content = 0
        self._args: list[int] = []  # per call, the argument characters sent
        self._done = False

    def read(self, text: str, final: bool) -> Reading:
        raise NotImplementedError

    def feed(self, text: str, final: bool = False) -> ParsedDelta:
        out = ParsedDelta()
        if self._done:
            return out
        self._text += text
        reading = self.read(self._text, final)
        out.content = reading.content[self._content :]
        self._content = max(self._content, len(reading.content))
        for k, (name, args) in enumerate(reading.calls):
            if k == len(self._args):
                out.calls.append(ToolCallDelta(k, openai_call_id(), name))
                self._args.append(0)
            piece = args[self._args[k] :]
            if piece:
                out.calls.append(ToolCallDelta(k, arguments=piece))
                self._args[k] = len(args)
        if final:
            for k, sent in enumerate(self._args):
                if sent == 0:
                    out.calls.append(ToolCallDelta(k, arguments="{}"))
            self._done = True
        return out


def dumps(value: object) -> str:
    """JSON text of an argument as the model wrote it: non-ASCII characters as themselves."""
    return json.dumps(value, ensure_ascii=False)


def string_part(key: str, partial: str) -> str:
    """`"key": "partial` : a JSON string member whose value may still grow (its closing quote not written)."""
    return f"{dumps(key)}: {dumps(partial)[:-1]}"
