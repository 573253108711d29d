"""Anthropic's answer shapes: the message (content blocks) and the event stream.

The answer's text goes through the same parsers as the chat route's (server/structured/parsing.py):
reasoning becomes a `thinking` block, tool calls become `tool_use` blocks with an `input` object, the rest
`text`. Streamed, each block is content_block_start, its deltas (thinking_delta, text_delta,
input_json_delta), content_block_stop, in the order the text produced them; then message_delta (stop
reason, usage) and message_stop. One parser per request, fed the same text streamed or not, so a client
assembling the stream gets exactly the non-streamed message.
"""

from __future__ import annotations

import secrets
import string
from typing import Any

from server.families.anthropic.protocol import (
    MessageResponse,
    MessageUsage,
    TextContent,
    ThinkingContent,
    ToolUseContent,
    encoder,
)
from server.families.anthropic.translate import stop_reason
from server.request.collector import Output
from server.request.openai_protocol import Usage
from server.structured.parsing import ChoiceParser
from server.tools.parser import arguments_object, assemble

_enc = encoder.encode
_ALNUM = string.ascii_letters + string.digits


def event(kind: bytes, payload: bytes) -> bytes:
    """One server-sent event as Anthropic names them: `event: <type>` then its JSON."""
    return b"event: " + kind + b"\ndata: " + payload + b"\n\n"


PING = event(b"ping", b'{"type":"ping"}')


def tool_use_id() -> str:
    return "toolu_" + "".join(secrets.choice(_ALNUM) for _ in range(24))


class MessagesFormatter:
    """One request's answer (Anthropic has no n). `parser`: None when nothing is parsed (one text block)."""

    def __init__(self, message_id: str, model: str, input_tokens: int, parser: ChoiceParser | None) -> None:
        self.id = message_id
        self.model = model
        self.input_tokens = input_tokens
        self.parser = parser
        self.direct_ok = parser is None  # a parser holds state: each output must be formatted exactly once
        self._open: str | None = None  # the open block's kind: "thinking" | "text" | "tool_use"
        self._index = -1  # the open (or last) block's index
        self._calls: dict[int, str] = {}  # parser's call index -> tool_use id

    # ------------------------------------------------------------------------------------ streamed

    def stream_start(self) -> bytes:
        message: dict[str, Any] = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": 0},
        }
        start = event(b"message_start", _enc({"type": "message_start", "message": message}))
        if self.parser is None:  # one text block for sure: open it first, as Anthropic does
            start += self._start("text", {"type": "text", "text": ""})
        return start + PING

    def _start(self, kind: str, block: dict[str, Any]) -> bytes:
        out = self._stop()
        self._index += 1
        self._open = kind
        return out + event(
            b"content_block_start", _enc({"type": "content_block_start", "index": self._index, "content_block": block})
        )

    def _stop(self) -> bytes:
        if self._open is None:
            return b""
        self._open = None
        return event(b"content_block_stop", b'{"type":"content_block_stop","index":%d}' % self._index)

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return event(
            b"content_block_delta", _enc({"type": "content_block_delta", "index": self._index, "delta": delta})
        )

    def _thinking(self, text: str) -> bytes:
        out = (
            b""
            if self._open == "thinking"
            else self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
        )
        return out + self._delta({"type": "thinking_delta", "thinking": text})

    def _text(self, text: str) -> bytes:
        out = b"" if self._open == "text" else self._start("text", {"type": "text", "text": ""})
        return out + self._delta({"type": "text_delta", "text": text})

    def stream_chunk(self, batch: list[Output], usage: Usage | None) -> bytes | None:
        out = batch[-1]  # one choice: a batch holds its one (merged) output
        final = out.finish_reason is not None
        data = b""
        finish = out.finish_reason
        if self.parser is None:
            if out.text:
                data += self._text(out.text)
        else:
            d = self.parser.feed(out.text, final)
            finish = self.parser.finish_reason(finish)
            if d.reasoning:
                data += self._thinking(d.reasoning)
            if d.content:
                data += self._text(d.content)
            for call in d.calls:
                if call.index not in self._calls:
                    self._calls[call.index] = tool_use_id()
                    data += self._start(
                        "tool_use",
                        {"type": "tool_use", "id": self._calls[call.index], "name": call.name or "", "input": {}},
                    )
                if call.arguments:
                    data += self._delta({"type": "input_json_delta", "partial_json": call.arguments})
        if final:
            if self._index < 0:  # an empty answer still has its one (empty) text block
                data += self._start("text", {"type": "text", "text": ""})
            reason, sequence = stop_reason(finish, out.stop_reason)
            delta = {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": {"input_tokens": self.input_tokens, "output_tokens": out.num_output_tokens},
            }
            data += (
                self._stop() + event(b"message_delta", _enc(delta)) + event(b"message_stop", b'{"type":"message_stop"}')
            )
        return data or None

    def usage_chunk(self, usage: Usage) -> bytes:  # never asked for: message_delta carries the usage
        return b""

    # --------------------------------------------------------------------------------- not streamed

    def final(self, outputs: list[Output], usage: Usage) -> bytes:
        out = outputs[0]
        finish = out.finish_reason
        content: list[ThinkingContent | TextContent | ToolUseContent] = []
        if self.parser is None:
            content.append(TextContent(out.text))
        else:
            d = self.parser.feed(out.text, True)
            finish = self.parser.finish_reason(finish)
            if d.reasoning:
                content.append(ThinkingContent(d.reasoning))
            if d.content:
                content.append(TextContent(d.content))
            for call in assemble(d.calls):
                args = arguments_object(call.arguments)
                if args is None:  # not an object: the model's text stays text rather than a broken tool_use
                    content.append(TextContent(call.arguments))
                else:
                    content.append(ToolUseContent(tool_use_id(), call.name, args))
            if not content:
                content.append(TextContent(""))
        reason, sequence = stop_reason(finish, out.stop_reason)
        return _enc(
            MessageResponse(
                id=self.id,
                model=self.model,
                content=content,
                stop_reason=reason,
                stop_sequence=sequence,
                usage=MessageUsage(usage.prompt_tokens, usage.completion_tokens),
            )
        )
