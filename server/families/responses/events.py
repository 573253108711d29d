"""The Responses API's answer: output items built from the parsed text, and the typed events that build them.

One `ResponseBuilder` per request is fed the answer's text (streamed: each output's text; not streamed: the
whole text at once) through the chat route's parsers (server/structured/parsing.py): reasoning becomes a
`reasoning` item, tool calls `function_call` items (arguments streamed as function_call_arguments deltas, never
as text), the rest a `message` item with one `output_text` part. The events carry increasing sequence_numbers;
the response object at the end is the same whichever way the text came, so a client assembling the stream gets
exactly the non-streamed response.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

from server.structured.parsing import ChoiceParser
from server.tools.parser import ToolCallDelta


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def usage_object(input_tokens: int, output_tokens: int, cached: int, reasoning: int = 0) -> dict[str, Any]:
    """The Responses usage; `reasoning`: the output tokens that wrote reasoning (streaming/reasoning_tokens.py)."""
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": input_tokens + output_tokens,
    }


def output_text(output: list[dict[str, Any]]) -> str:
    return "".join(
        part["text"]
        for item in output
        if item["type"] == "message"
        for part in item["content"]
        if part["type"] == "output_text"
    )


class ResponseBuilder:
    """One response: its output items and the events that built them (`take_events`)."""

    def __init__(self, base: dict[str, Any], parser: ChoiceParser | None) -> None:
        self.base = base  # the response object's fields other than status / output / usage
        self.parser = parser
        self.output: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.seq = 0
        self._open: dict[str, Any] | None = None  # the item being written
        self._calls: dict[int, dict[str, Any]] = {}  # the parser's call index -> its function_call item
        self.called = False
        self._logprobs: list[dict[str, Any]] = []  # tokens not yet given to a text delta

    def _emit(self, kind: str, **fields: Any) -> None:
        self.events.append({"type": kind, "sequence_number": self.seq, **fields})
        self.seq += 1

    def _part_event(self, kind: str, item: dict[str, Any], index: int, **fields: Any) -> None:
        """An event about the one content part of `item` (output[index])."""
        self._emit(kind, item_id=item["id"], output_index=index, content_index=0, **fields)

    def take_events(self) -> list[dict[str, Any]]:
        events, self.events = self.events, []
        return events

    def response(self, status: str, usage: dict[str, Any] | None, reason: str | None = None) -> dict[str, Any]:
        return {
            **self.base,
            "status": status,
            "incomplete_details": {"reason": reason} if reason else None,
            "output": [_copy(item) for item in self.output],
            "output_text": output_text(self.output),
            "usage": usage,
        }

    def start(self) -> None:
        self._emit("response.created", response=self.response("in_progress", None))
        self._emit("response.in_progress", response=self.response("in_progress", None))

    # ------------------------------------------------------------------------------------- items

    def _add(self, item: dict[str, Any]) -> int:
        self._close()
        self.output.append(item)
        self._open = item
        self._emit("response.output_item.added", output_index=len(self.output) - 1, item=_copy(item))
        return len(self.output) - 1

    def _close(self, status: str = "completed") -> None:
        item, self._open = self._open, None
        if item is None:
            return
        index = self.output.index(item)
        if item["type"] == "message":
            part = item["content"][0]
            self._part_event(
                "response.output_text.done", item, index, text=part["text"], logprobs=list(part["logprobs"])
            )
            self._part_event("response.content_part.done", item, index, part=dict(part))
        elif item["type"] == "reasoning":
            self._part_event("response.reasoning_text.done", item, index, text=item["content"][0]["text"])
        else:
            self._emit(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                name=item["name"],
                arguments=item["arguments"],
            )
        item["status"] = status
        self._emit("response.output_item.done", output_index=index, item=_copy(item))

    def _text(self, text: str) -> None:
        item = self._open
        if item is None or item["type"] != "message":
            item = {"id": new_id("msg"), "type": "message", "status": "in_progress", "role": "assistant", "content": []}
            index = self._add(item)
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item["content"].append(part)
            self._part_event("response.content_part.added", item, index, part=dict(part, logprobs=[]))
        logprobs, self._logprobs = self._logprobs, []
        item["content"][0]["text"] += text
        item["content"][0]["logprobs"] = item["content"][0]["logprobs"] + logprobs
        self._part_event("response.output_text.delta", item, len(self.output) - 1, delta=text, logprobs=logprobs)

    def _reasoning(self, text: str) -> None:
        item = self._open
        if item is None or item["type"] != "reasoning":
            item = {
                "id": new_id("rs"),
                "type": "reasoning",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": ""}],
                "status": "in_progress",
            }
            self._add(item)
        item["content"][0]["text"] += text
        self._part_event("response.reasoning_text.delta", item, len(self.output) - 1, delta=text)

    def _call(self, call: ToolCallDelta) -> None:
        self.called = True
        item = self._calls.get(call.index)
        if item is None:
            item = self._calls[call.index] = {
                "id": new_id("fc"),
                "type": "function_call",
                "status": "in_progress",
                "call_id": new_id("call"),
                "name": call.name or "",
                "arguments": "",
            }
            self._add(item)
        if call.arguments:
            item["arguments"] += call.arguments
            self._emit(
                "response.function_call_arguments.delta",
                item_id=item["id"],
                output_index=self.output.index(item),
                delta=call.arguments,
            )

    # --------------------------------------------------------------------------------- feeding

    def feed(self, text: str, final: bool, logprobs: list[dict[str, Any]] | None = None) -> None:
        """The answer's next text; `logprobs`: its tokens' (include message.output_text.logprobs, no parser)."""
        self._logprobs += logprobs or []
        if self.parser is None:
            if text:
                self._text(text)
            return
        d = self.parser.feed(text, final)
        if d.reasoning:
            self._reasoning(d.reasoning)
        if d.content:
            self._text(d.content)
        for call in d.calls:
            self._call(call)

    def finish(self, finish_reason: str | None, usage: dict[str, Any]) -> dict[str, Any]:
        """Close the last item and end: response.completed, or response.incomplete (the output token limit)."""
        if self._logprobs and self._open is not None and self._open["type"] == "message":
            self._text("")  # the last tokens' logprobs (an end token writes no text), whichever way the text came
        self._close("incomplete" if finish_reason == "length" else "completed")  # cut by the limit: as OpenAI
        if finish_reason == "length":
            done = self.response("incomplete", usage, "max_output_tokens")
            self._emit("response.incomplete", response=done)
        else:
            done = self.response("completed", usage)
            self._emit("response.completed", response=done)
        return done


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    """An item as it stands now (its content parts too: they change while it streams)."""
    out = dict(item)
    if "content" in out:
        out["content"] = [dict(p, logprobs=list(p["logprobs"])) if "logprobs" in p else dict(p) for p in out["content"]]
    return out


def sse_event(event: dict[str, Any], encode: Callable[[Any], bytes]) -> bytes:
    """One server-sent event named by its type, as OpenAI sends them."""
    kind: str = event["type"]
    return b"event: " + kind.encode() + b"\ndata: " + encode(event) + b"\n\n"
