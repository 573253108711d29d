"""The model a request names, read by the front app before the model's own routes see the body: the JSON body's
`model` (and `stream`), or a multipart form's `model` field (the audio routes)."""

from __future__ import annotations

import re

import msgspec

from server.http.asgi import Message, Receive, Scope, header
from server.http.errors import APIError


class _Routing(msgspec.Struct):
    model: str | None = None
    stream: bool | None = None
    keep_alive: float | str | None = None  # Ollama's: 0 unloads the model after the request


def keep_alive_of(body: bytes) -> float | str | None:
    try:
        return _decoder.decode(body).keep_alive if body else None
    except msgspec.DecodeError:
        return None


_decoder = msgspec.json.Decoder(_Routing)
_FORM_MODEL = re.compile(rb'name="model"\r\n(?:[^\r\n]+\r\n)*\r\n([^\r\n]*)\r\n')


def routing_of(scope: Scope, body: bytes) -> tuple[str | None, bool]:
    """(the model named, whether the answer streams). A body that is not JSON (nor a form) is a 400."""
    content_type = (header(scope, b"content-type") or "").lower()
    if content_type.startswith("multipart/form-data"):
        found = _FORM_MODEL.search(body)
        stream = re.search(rb'name="stream"\r\n(?:[^\r\n]+\r\n)*\r\n(true|1)\r\n', body) is not None
        return (found.group(1).decode("utf-8", "replace") if found else None), stream
    if not body:
        return None, False
    try:
        routing = _decoder.decode(body)
    except msgspec.DecodeError as e:
        raise APIError(f"The request body is not a JSON object with a string `model`: {e}") from None
    return routing.model, bool(routing.stream)


def replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the body already read, then the client's own messages (its disconnect)."""
    sent = False

    async def again() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again
