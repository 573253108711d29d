"""Ollama's answers: one JSON object per line (NDJSON), `done: false` chunks then one `done: true` chunk with
`done_reason` and the timings in nanoseconds; not streamed, that last object alone with the whole answer. /api/chat
puts the text in `message` (with `thinking` and `tool_calls`, arguments as objects), /api/generate in `response`
(and `thinking`). One parser per request, fed the same text streamed or not."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from server.families.ollama.protocol import encoder
from server.http.errors import ollama_error_body
from server.request.collector import Output
from server.request.formatter import StreamFraming
from server.request.openai_protocol import Usage
from server.structured.parsing import ChoiceParser
from server.tools.parser import ToolCallDelta, arguments_object, assemble

_enc = encoder.encode
NDJSON = ((b"content-type", b"application/x-ndjson"), (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no"))
FRAMING = StreamFraming(done=b"", keepalive=b"", error=lambda e: ollama_error_body(e.message) + b"\n", headers=NDJSON)


def created_at() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def done_reason(finish: str | None) -> str:
    return "length" if finish == "length" else "stop"


class OllamaFormatter:
    """One request's answer (Ollama has no n). `chat`: /api/chat's `message`, else /api/generate's `response`.
    `parser`: None when nothing is parsed (the text as it comes). `load_ns`: the model's load time, reported by
    the first request after a load. `context`: the prompt's ids, when the last line gives /api/generate's
    `context` (the prompt's and the answer's ids, for the next request to continue)."""

    def __init__(
        self,
        model: str,
        prompt_tokens: int,
        parser: ChoiceParser | None,
        *,
        chat: bool,
        load_ns: int = 0,
        context: list[int] | None = None,
    ) -> None:
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.parser = parser
        self.chat = chat
        self.load_ns = load_ns
        self.context = None if context is None else list(context)  # grows by each output's ids
        # a parser or the context's ids hold state: each output must be formatted exactly once
        self.direct_ok = parser is None and context is None
        self._start = time.monotonic_ns()
        self._first: int | None = None  # when the first output came: the prompt's evaluation ended
        self._calls: list[ToolCallDelta] = []
        self._head = _enc({"model": model})[:-1] + b',"created_at":'

    def _line(self, fields: dict[str, Any]) -> bytes:
        return self._head + _enc(created_at()) + b"," + _enc(fields)[1:] + b"\n"

    def _answer(self, content: str, thinking: str = "", calls: list[ToolCallDelta] | None = None) -> dict[str, Any]:
        if not self.chat:
            out: dict[str, Any] = {"response": content}
            if thinking:
                out["thinking"] = thinking
            return out
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if thinking:
            message["thinking"] = thinking
        made = []
        for call in assemble(calls or []):
            args = arguments_object(call.arguments)
            if args is None:  # not an object: the model's text stays text rather than a broken call
                message["content"] += call.arguments
            else:
                made.append({"function": {"name": call.name, "arguments": args}})
        if made:
            message["tool_calls"] = made
        return {"message": message}

    def _parse(self, out: Output, final: bool) -> tuple[str, str, list[ToolCallDelta]]:
        if self.parser is None:
            return out.text, "", []
        d = self.parser.feed(out.text, final)
        return d.content, d.reasoning, d.calls

    def _done(self, out: Output) -> dict[str, Any]:
        end = time.monotonic_ns()
        first = self._first if self._first is not None else end
        done = {
            "done": True,
            "done_reason": done_reason(out.finish_reason),
            "total_duration": end - self._start + self.load_ns,  # as Ollama's: the load is part of the total
            "load_duration": self.load_ns,
            "prompt_eval_count": self.prompt_tokens,
            "prompt_eval_duration": first - self._start,
            "eval_count": out.num_output_tokens,
            "eval_duration": end - first,
        }
        if self.context is not None:
            done["context"] = self.context
        return done

    def _ids(self, out: Output) -> None:
        if self.context is not None:
            self.context += out.token_ids

    def stream_start(self) -> bytes | None:
        return None

    def stream_chunk(self, batch: list[Output], usage: Usage | None) -> bytes | None:
        out = batch[-1]  # one choice: a batch holds its one (merged) output
        if self._first is None:
            self._first = time.monotonic_ns()
        self._ids(out)
        final = out.finish_reason is not None
        content, thinking, calls = self._parse(out, final)
        self._calls += calls
        if not final:
            if not (content or thinking):
                return None  # held back by a parser
            return self._line({**self._answer(content, thinking), "done": False})
        return self._line({**self._answer(content, thinking, self._calls), **self._done(out)})

    def usage_chunk(self, usage: Usage) -> bytes:  # never asked for: the last chunk carries the counts
        return b""

    def final(self, outputs: list[Output], usage: Usage) -> bytes:
        out = outputs[0]
        self._first = self._start  # not streamed: the prompt's share of the time is not seen apart
        self._ids(out)
        content, thinking, calls = self._parse(out, True)
        return self._line({**self._answer(content, thinking, calls), **self._done(out)})[:-1]
