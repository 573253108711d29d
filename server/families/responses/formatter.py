"""The Responses API's Formatter for `respond`: the event stream (streamed) or the response object (not), both
from one ResponseBuilder (server/families/responses/events.py). `done` holds the finished response object, for
the route to store."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from server.families.responses.events import ResponseBuilder, sse_event, usage_object
from server.families.responses.protocol import encoder
from server.reasoning.token_count import Decode, reasoning_tokens
from server.request.collector import Output
from server.request.openai_protocol import Usage
from server.structured.parsing import ChoiceParser

_enc = encoder.encode


class ResponsesFormatter:
    """One request's answer (the Responses API has no n). `new_parser`: a fresh parser, None: nothing parsed."""

    def __init__(
        self,
        base: dict[str, Any],
        input_tokens: int,
        new_parser: Callable[[], ChoiceParser | None],
        logprobs: Callable[[Output], list[dict[str, Any]]] | None = None,
        decode: Decode | None = None,
    ) -> None:
        self.base = base
        self.decode = decode  # token ids -> text, to count reasoning tokens (None: no reasoning parser)
        self.ids: list[int] = []  # the answer's token ids so far (streamed)
        self.logprobs = logprobs  # an output's token logprobs in the Responses shape (None: not asked for)
        self.input_tokens = input_tokens
        self.new_parser = new_parser
        self.builder = ResponseBuilder(base, new_parser())
        self.direct_ok = False  # the builder holds state: each output must be formatted exactly once
        self.done: dict[str, Any] | None = None

    def _events(self) -> bytes:
        return b"".join(sse_event(e, _enc) for e in self.builder.take_events())

    def stream_start(self) -> bytes:
        self.builder.start()
        return self._events()

    def stream_chunk(self, batch: list[Output], usage: Usage | None) -> bytes | None:
        out = batch[-1]  # one choice: a batch holds its one (merged) output
        final = out.finish_reason is not None
        if self.decode is not None:
            self.ids += out.token_ids
        self.builder.feed(out.text, final, self.logprobs(out) if self.logprobs is not None else None)
        if final:
            self.done = self.builder.finish(
                out.finish_reason,
                usage_object(
                    self.input_tokens,
                    out.num_output_tokens,
                    out.num_cached_tokens,
                    self._reasoning(self.builder, self.ids),
                ),
            )
        return self._events() or None

    def usage_chunk(self, usage: Usage) -> bytes:  # never asked for: response.completed carries the usage
        return b""

    def final(self, outputs: list[Output], usage: Usage) -> bytes:
        out = outputs[0]
        builder = ResponseBuilder(self.base, self.new_parser())
        builder.feed(out.text, True, self.logprobs(out) if self.logprobs is not None else None)
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        self.done = builder.finish(
            out.finish_reason,
            usage_object(usage.prompt_tokens, usage.completion_tokens, cached, self._reasoning(builder, out.token_ids)),
        )
        return _enc(self.done)

    def _reasoning(self, builder: ResponseBuilder, ids: list[int]) -> int:
        parser = builder.parser.reasoning if builder.parser is not None else None
        return reasoning_tokens(parser, ids, self.decode) if self.decode is not None else 0
