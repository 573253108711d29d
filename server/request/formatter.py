"""What a wire format hands the responders: a Formatter (its chunks and its body) and a StreamFraming (a
stream's bytes that are not chunks); and the usage both count the same way."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from server.http import sse, unavailable
from server.http.asgi import SSE_HEADERS
from server.http.errors import APIError
from server.request.async_llm import AsyncLLM
from server.request.collector import Output
from server.request.input_processor import GenerationSpec
from server.request.openai_protocol import PromptTokensDetails, Usage


class Formatter(Protocol):
    @property
    def direct_ok(self) -> bool:
        """False for a formatter with per-choice state (a parser): each output must be formatted exactly once,
        so the output handler may not format and write chunks itself (it would format the declined ones twice)."""
        ...

    def stream_start(self) -> bytes | None: ...
    def stream_chunk(self, batch: list[Output], usage: Usage | None) -> bytes | None: ...
    def usage_chunk(self, usage: Usage) -> bytes: ...
    def final(self, outputs: list[Output], usage: Usage) -> bytes: ...


@dataclass(frozen=True)
class StreamFraming:
    """A stream's bytes that are not chunks: OpenAI's by default; another wire format (Anthropic's) brings its own."""

    done: bytes = sse.DONE  # ends the stream
    keepalive: bytes = sse.KEEPALIVE  # sent on silence before the first token
    error: Callable[[APIError], bytes] = sse.error_frame  # an error after the response started
    headers: tuple[tuple[bytes, bytes], ...] = tuple(SSE_HEADERS)  # the stream's content type (Ollama's: NDJSON)


OPENAI_FRAMING = StreamFraming()


class UsageCounter:
    """Prompt tokens once per prompt (shared by its n choices), completion tokens summed over choices."""

    def __init__(self, specs: Sequence[GenerationSpec]) -> None:
        self.prompt_tokens = sum(len(s.prompt_token_ids) for s in specs)
        self._spec_of = {s.index_offset + i: k for k, s in enumerate(specs) for i in range(s.n)}
        self._completion: dict[int, int] = {}
        self._cached: dict[int, int] = {}  # per spec: its prompt's cached tokens

    def add(self, batch: list[Output]) -> None:
        for out in batch:
            self._completion[out.index] = out.num_output_tokens
            if out.num_cached_tokens:
                k = self._spec_of.get(out.index, 0)
                self._cached[k] = max(self._cached.get(k, 0), out.num_cached_tokens)

    def usage(self) -> Usage:
        completion = sum(self._completion.values())
        return Usage(
            self.prompt_tokens,
            completion,
            self.prompt_tokens + completion,
            PromptTokensDetails(sum(self._cached.values())),
        )


def output_error(llm: AsyncLLM, out: Output) -> APIError:
    """An output's error as the client sees it (the status, or the SSE error event's code)."""
    if llm.dead is not None:  # the engine died under it: a server fault, as issue 3 specifies
        return APIError(f"{out.error}", status=500)
    if llm.stopping.is_set():  # cut by shutdown: the client should retry elsewhere
        return unavailable.unavailable(f"{out.error}")
    return APIError(out.error or "the request failed", status=400)
