"""Tool-call parsing from model text, streamed or not, with one code path for both.

A parser is fed the output text in any cuts (`feed(delta, final)`) and returns what became certain:
content text and tool-call deltas (index, id and name once, then argument fragments). The non-streamed
answer is the same parser fed the whole text at once, so the calls a client assembles from a stream
equal the non-streamed calls for every way the text was cut (the scanner is prefix-monotone and nothing
sent is retracted). A tag split across deltas is held back; text inside a tool-call block never leaks
as content unless the block turns out to hold no call at all, in which case it is content, verbatim.
"""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from engine.messages import StructuredOutputs
from server.tools.grammar import call_schema, lark_calls, lark_json, lark_tag
from server.tools.mistral import ArgsFormRewriter, args_form_constraint
from server.tools.scan import ObjectScan, held, json_string, scan_object, skip_ws, value_end

_WS = " \t\n\r"
_ALNUM = string.ascii_letters + string.digits


def openai_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ALNUM) for _ in range(24))


def mistral_call_id() -> str:
    """Mistral's tool-call ids: exactly 9 alphanumeric characters (its templates refuse others)."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


@dataclass
class ToolCallDelta:
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as the model wrote it


@dataclass
class ParsedDelta:
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def extend(self, other: ParsedDelta) -> None:
        self.content += other.content
        self.calls.extend(other.calls)


def assemble(deltas: Iterable[ToolCallDelta]) -> list[ToolCall]:
    """The calls a client builds from deltas (as the openai SDK does: by index, arguments concatenated)."""
    calls: dict[int, ToolCall] = {}
    for d in deltas:
        call = calls.get(d.index)
        if call is None:
            call = calls[d.index] = ToolCall(d.id or "", d.name or "", "")
        if d.name is not None and not call.name:
            call.name = d.name
        call.arguments += d.arguments
    return [calls[i] for i in sorted(calls)]


def arguments_object(arguments: str) -> dict[str, Any] | None:
    """A call's arguments as the object APIs that send them parsed want (None: the model's text is not a JSON
    object; empty text is {})."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


class ToolParser:
    """Streaming parser interface; `extract` is the non-streamed answer."""

    name = ""
    skip_special_tokens = True  # False: the parser needs special tokens in the text (mistral's [TOOL_CALLS])
    markers: tuple[str, ...] = ()  # texts a chat template teaching this format holds (any one of them)

    def feed(self, text: str, final: bool = False) -> ParsedDelta:
        raise NotImplementedError

    @classmethod
    def factory(cls, functions: dict[str, dict[str, Any]]) -> Callable[[], ToolParser]:
        """One choice's parser for a request with these functions (name -> parameters schema)."""
        return cls

    @classmethod
    def constraint(
        cls, functions: dict[str, dict[str, Any]], multiple: bool, token_id: Callable[[str], int | None]
    ) -> StructuredOutputs:
        """The grammar that makes the model write one call (or, `multiple`, at least one) to `functions`
        in this parser's format, arguments valid against each function's parameters."""
        raise NotImplementedError

    @classmethod
    def extract(cls, text: str, **kwargs: object) -> tuple[str | None, list[ToolCall]]:
        parser = cls(**kwargs)
        out = parser.feed(text, final=True)
        return (out.content or None), assemble(out.calls)


@dataclass
class _CallState:
    index: int = -1  # -1: its name is not known yet (nothing sent)
    args_sent: int = 0


class JsonCallParser(ToolParser):
    """Calls as JSON objects {"name": ..., "arguments": {...}} inside regions of the text.

    start: the tag that opens a region (None: the whole output is one region); end: the tag that closes it
    (None: the region ends with its JSON value); array: a region holds a JSON list of calls (or one call).
    """

    start: str | None = None
    end: str | None = None
    array = False
    args_keys: tuple[str, ...] = ("arguments", "parameters")
    new_id: Callable[[], str] = staticmethod(openai_call_id)

    def __init__(self) -> None:
        self._buf = ""
        self._inside = False
        self._began = False  # a start-less parser has opened its one region
        self._seen_region = False
        self._ws_hold = ""
        self._calls: list[_CallState] = []
        self._next_index = 0
        self._done = False

    # -- the driver ------------------------------------------------------------------------------

    def feed(self, text: str, final: bool = False) -> ParsedDelta:
        out = ParsedDelta()
        if self._done:
            return out
        self._buf += text
        while True:
            if not self._inside:
                if self.start is None:
                    if not self._began:
                        self._began = self._inside = True
                        continue
                    out.content += self._outside(self._buf, False, final)
                    self._buf = ""
                    break
                pos = self._buf.find(self.start)
                if pos >= 0:
                    out.content += self._outside(self._buf[:pos], True, final)
                    self._buf = self._buf[pos + len(self.start) :]
                    self._inside = self._seen_region = True
                    self._calls = []
                    continue
                hold = 0 if final else held(self._buf, self.start)
                cut = len(self._buf) - hold
                out.content += self._outside(self._buf[:cut], False, final)
                self._buf = self._buf[cut:]
                break
            if self.end is not None:
                pos = self._buf.find(self.end)
                if pos >= 0:
                    self._close_region(out, pos, self.end, final)
                    continue
                if final:
                    self._close_region(out, len(self._buf), "", final)
                    break
                self._progress(self._buf[: len(self._buf) - held(self._buf, self.end)], out)
                break
            i = skip_ws(self._buf, 0)
            end = value_end(self._buf, i) if i < len(self._buf) and self._buf[i] in "[{" else None
            if i < len(self._buf) and self._buf[i] not in "[{":  # not a call: the region is content
                self._close_region(out, len(self._buf), "", final)
                break
            if end is not None:
                self._close_region(out, end, "", final)
                continue
            if final:
                self._close_region(out, len(self._buf), "", final)
                break
            self._progress(self._buf, out)
            break
        if final:
            self._done = True
        return out

    def _outside(self, text: str, before_region: bool, final: bool) -> str:
        """Content outside regions; whitespace next to a region is dropped (it only separates calls)."""
        s = self._ws_hold + text
        if before_region:
            self._ws_hold = ""
            return s.rstrip(_WS)
        if final:
            self._ws_hold = ""
            return s.rstrip(_WS) if self._seen_region else s
        k = len(s.rstrip(_WS))
        self._ws_hold = s[k:]
        return s[:k]

    # -- regions ---------------------------------------------------------------------------------

    def _objects(self, text: str) -> list[ObjectScan]:
        i = skip_ws(text, 0)
        if i >= len(text):
            return []
        if text[i] == "{":
            return [scan_object(text, i)]
        if text[i] != "[" or not self.array:
            return []
        found: list[ObjectScan] = []
        i = skip_ws(text, i + 1)
        while i < len(text) and text[i] == "{":
            scan = scan_object(text, i)
            found.append(scan)
            if scan.end is None:
                break
            i = skip_ws(text, scan.end)
            if i < len(text) and text[i] == ",":
                i = skip_ws(text, i + 1)
                continue
            break
        return found

    def _progress(self, text: str, out: ParsedDelta) -> None:
        """Send what `text` (the region so far, a held-back tag excluded) makes certain."""
        for k, scan in enumerate(self._objects(text)):
            if k == len(self._calls):
                self._calls.append(_CallState())
            state = self._calls[k]
            name = next((m for m in scan.members if m.key == "name"), None)
            args = next((m for m in scan.members if m.key in self.args_keys), None)
            if state.index < 0:
                value = json_string(text[name.start : name.end]) if name is not None and name.end is not None else None
                if value is None:
                    continue
                state.index = self._next_index
                self._next_index += 1
                out.calls.append(ToolCallDelta(state.index, self.new_id(), value))
            if args is not None:
                stop = args.end if args.end is not None else len(text)
                piece = text[args.start + state.args_sent : stop]
                if piece:
                    state.args_sent += len(piece)
                    out.calls.append(ToolCallDelta(state.index, arguments=piece))

    def _close_region(self, out: ParsedDelta, cut: int, closing: str, final: bool) -> None:
        """The region is the buffer's first `cut` characters, then its closing tag `closing`: finish it."""
        out.extend(self._finish_region(self._buf[:cut], closing, final))
        self._buf = self._buf[cut + len(closing) :]
        self._inside = False

    def _finish_region(self, text: str, closing: str, final: bool) -> ParsedDelta:
        out = ParsedDelta()
        self._progress(text, out)
        if not any(s.index >= 0 for s in self._calls):  # no call in it: the region was text after all
            out.content += self._outside((self.start or "") + text + closing, False, final)
            out.calls = []
        for state in self._calls:
            if state.index >= 0 and state.args_sent == 0:
                out.calls.append(ToolCallDelta(state.index, arguments="{}"))
                state.args_sent = 2
        self._calls = []
        return out


class HermesParser(JsonCallParser):
    """Hermes / Qwen2.5: <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>, one call per block."""

    name = "hermes"
    markers = ("<tool_call>",)
    start = "<tool_call>"
    end = "</tool_call>"

    @classmethod
    def constraint(
        cls, functions: dict[str, dict[str, Any]], multiple: bool, token_id: Callable[[str], int | None]
    ) -> StructuredOutputs:
        open_tag = lark_tag("<tool_call>", token_id) + ' "\\n"'
        close_tag = '"\\n" ' + lark_tag("</tool_call>", token_id)
        return StructuredOutputs(
            "grammar", lark_calls(functions, open_tag=open_tag, close_tag=close_tag, sep="\n", multiple=multiple)
        )


class MistralParser(JsonCallParser):
    """Mistral: [TOOL_CALLS] then a JSON list of {"name", "arguments"}, or (tokenizers v11 and later)
    [TOOL_CALLS]name[ARGS]{...} per call (server/tools/mistral.py); ids are 9 alphanumerics."""

    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    start = "[TOOL_CALLS]"
    array = True
    skip_special_tokens = False  # [TOOL_CALLS] is a control token in Mistral's tokenizers
    new_id = staticmethod(mistral_call_id)

    def __init__(self) -> None:
        super().__init__()
        self._rewriter = ArgsFormRewriter()

    def feed(self, text: str, final: bool = False) -> ParsedDelta:
        return super().feed(self._rewriter.feed(text, final), final)

    @classmethod
    def constraint(
        cls, functions: dict[str, dict[str, Any]], multiple: bool, token_id: Callable[[str], int | None]
    ) -> StructuredOutputs:
        if token_id("[ARGS]") is not None:  # a v11+ tokenizer: the model was trained on the newer form
            return args_form_constraint(functions, multiple, token_id)
        calls = [call_schema(n, p) for n, p in functions.items()]
        items = calls[0] if len(calls) == 1 else {"anyOf": calls}
        schema = {"type": "array", "minItems": 1, "items": items}
        if not multiple:
            schema["maxItems"] = 1
        return StructuredOutputs(
            "grammar", f"start: {lark_tag('[TOOL_CALLS]', token_id)} calls\ncalls: {lark_json(schema)}\n"
        )


class JsonListParser(JsonCallParser):
    """No parser configured, tool_choice "required": the output is a JSON list of {"name", "parameters"}
    (vLLM's format), enforced by a JSON-schema constraint."""

    array = True


class NamedArgsParser(ToolParser):
    """No parser configured, a named tool_choice: the whole output is the arguments of that one call."""

    def __init__(self, function: str, new_id: Callable[[], str] = openai_call_id) -> None:
        self._function = function
        self._new_id = new_id
        self._started = False

    def feed(self, text: str, final: bool = False) -> ParsedDelta:
        out = ParsedDelta()
        if not self._started:
            self._started = True
            out.calls.append(ToolCallDelta(0, self._new_id(), self._function))
        if text:
            out.calls.append(ToolCallDelta(0, arguments=text))
        return out
