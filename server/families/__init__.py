"""One package per API family: its wire structs (protocol.py), its routes, its formatter and what only it uses.
Below them all, server/request/ is the path every family shares. A family's one property the other apps need is
the shape of its errors (the --models-dir front answers for its routes before a model's app does)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from server.http.asgi import Send, send_error, send_json
from server.http.errors import APIError, anthropic_error_body, ollama_error_body


class ErrorShape(enum.Enum):
    """How a family's routes answer an error, as a body and inside a stream."""

    OPENAI = "openai"  # {"error": {"message", "type", "param", "code"}}
    ANTHROPIC = "anthropic"  # {"type": "error", "error": {"type", "message"}}
    OLLAMA = "ollama"  # {"error": "message"}

    def body(self, error: APIError) -> bytes:
        if self is ErrorShape.ANTHROPIC:
            return anthropic_error_body(error.status, error.message)
        if self is ErrorShape.OLLAMA:
            return ollama_error_body(error.message)
        return error.body()

    async def send(self, send: Send, error: APIError) -> None:
        if self is not ErrorShape.OPENAI:
            extra = [] if error.retry_after is None else [(b"retry-after", str(error.retry_after).encode())]
            await send_json(send, error.status, self.body(error), extra)
        else:
            await send_error(send, error)

    @property
    def sse_error_prefix(self) -> bytes:
        """How an error event starts in the family's streams: Anthropic's names its event."""
        if self is ErrorShape.OLLAMA:  # NDJSON: an error is one more line
            return b""
        return b"event: error\ndata: " if self is ErrorShape.ANTHROPIC else b"data: "


@dataclass(frozen=True)
class Family:
    name: str
    errors: ErrorShape = ErrorShape.OPENAI
