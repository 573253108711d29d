"""A strict SSE reader for tests: every event must be `data: ...` + blank line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx


def events(response: httpx.Response) -> Iterator[Any]:
    """Decoded JSON events of a stream; stops at [DONE] (which must come last)."""
    buf = ""
    done = False
    for text in response.iter_text():
        buf += text
        while "\n\n" in buf:
            raw, buf = buf.split("\n\n", 1)
            if raw.startswith(":"):
                continue  # keep-alive comment
            assert raw.startswith("data: "), raw
            assert not done, "event after [DONE]"
            payload = raw[len("data: ") :]
            if payload == "[DONE]":
                done = True
                continue
            yield json.loads(payload)
    assert done and buf == "", f"stream did not end with [DONE] (left {buf!r})"
