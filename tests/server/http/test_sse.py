"""SSE framing: events parse back with a plain SSE reader; an error after the start is an event then [DONE]."""

from __future__ import annotations

import json

from server.http import sse
from server.http.errors import APIError


def parse(stream: bytes) -> list[str]:
    """A minimal SSE reader (the spec's rules for `data:` lines and blank-line dispatch)."""
    events, data = [], []
    for line in stream.decode().split("\n"):
        if line == "":
            if data:
                events.append("\n".join(data))
                data = []
        elif line.startswith(":"):
            continue
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
    return events


def test_frames_and_done() -> None:
    payload = json.dumps({"text": "a\nb \u2028 c"}, ensure_ascii=False).encode()
    stream = sse.frame(payload) + sse.KEEPALIVE + sse.frame(b'{"x":1}') + sse.DONE
    events = parse(stream)
    assert events == [payload.decode(), '{"x":1}', "[DONE]"]
    assert json.loads(events[0])["text"] == "a\nb \u2028 c"


def test_error_event() -> None:
    err = APIError("engine core died", status=503)
    events = parse(sse.error_frame(err) + sse.DONE)
    assert json.loads(events[0]) == {
        "error": {"message": "engine core died", "type": "ServiceUnavailableError", "param": None, "code": 503}
    }
    assert events[1] == "[DONE]"
