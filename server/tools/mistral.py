"""Mistral's newer tool-call form, `[TOOL_CALLS]name[ARGS]{...}` (tokenizers v11 and later), read as the older one.

Each call has its own `[TOOL_CALLS]`; a `[CALL_ID]id` may sit between the name and `[ARGS]`. The rewriter
turns the text, as it streams, into `[TOOL_CALLS]{"name": "name", "arguments": {...}}`, which MistralParser
already reads: the arguments pass through verbatim, so the client gets the model's own argument text, and
the rewrite is prefix-monotone (what it emits for a prefix is never taken back).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from engine.messages import StructuredOutputs
from server.tools.grammar import lark_json, lark_tag
from server.tools.scan import held, skip_ws, value_end

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
MAX_NAME = 512  # characters after [TOOL_CALLS] without [ARGS]: not this form (the text is passed as it is)


class ArgsFormRewriter:
    def __init__(self) -> None:
        self._buf = ""
        self._state = "out"  # out: outside a call; head: after [TOOL_CALLS]; args: inside the arguments
        self._sent = 0  # of the arguments in _buf, the characters already emitted

    def feed(self, text: str, final: bool = False) -> str:
        out: list[str] = []
        self._buf += text
        while True:
            if self._state == "out":
                pos = self._buf.find(TOOL_CALLS)
                if pos < 0:
                    cut = len(self._buf) - (0 if final else held(self._buf, TOOL_CALLS))
                    out.append(self._buf[:cut])
                    self._buf = self._buf[cut:]
                    break
                out.append(self._buf[: pos + len(TOOL_CALLS)])
                self._buf = self._buf[pos + len(TOOL_CALLS) :]
                self._state = "head"
                continue
            if self._state == "head":
                i = skip_ws(self._buf, 0)
                if i < len(self._buf) and self._buf[i] in "[{" and not self._buf.startswith((ARGS, CALL_ID), i):
                    self._state = "out"  # the older list form: the parser reads it as it is
                    continue
                pos = self._buf.find(ARGS)
                if pos < 0:
                    if final or len(self._buf) > MAX_NAME:
                        self._state = "out"
                        continue
                    break
                name = self._buf[:pos]
                if CALL_ID in name:
                    name = name[: name.index(CALL_ID)]
                out.append('{"name": ' + json.dumps(name.strip()) + ', "arguments": ')
                self._buf = self._buf[pos + len(ARGS) :]
                self._state, self._sent = "args", 0
                continue
            end = value_end(self._buf, skip_ws(self._buf, 0))
            if end is None:  # the arguments so far, as they come
                out.append(self._buf[self._sent :])
                self._sent = len(self._buf)
                if final:
                    self._buf, self._state = "", "out"
                break
            out.append(self._buf[self._sent : end] + "}")
            self._buf = self._buf[end:]
            self._state = "out"
        return "".join(out)


def args_form_constraint(
    functions: dict[str, dict[str, Any]], multiple: bool, token_id: Callable[[str], int | None]
) -> StructuredOutputs:
    """One call (or several) as [TOOL_CALLS]name[ARGS]{arguments valid against the function's parameters}."""
    rules = [
        f"fn_{i}: {json.dumps(name)} {lark_tag(ARGS, token_id)} args_{i}\nargs_{i}: {lark_json(params)}"
        for i, (name, params) in enumerate(functions.items())
    ]
    fns = " | ".join(f"fn_{i}" for i in range(len(functions)))
    start = "start: call+" if multiple else "start: call"
    return StructuredOutputs(
        "grammar", f"{start}\ncall: {lark_tag(TOOL_CALLS, token_id)} fn\nfn: {fns}\n" + "\n".join(rules) + "\n"
    )
