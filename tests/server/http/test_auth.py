"""API keys are compared as bytes: a non-ASCII key works when the client sends it UTF-8 encoded."""

from __future__ import annotations

from typing import Any

import pytest

from server.http.auth import APIKeyAuth

pytestmark = pytest.mark.anyio

KEY = "clé-ключ-🔑"


async def status(auth: APIKeyAuth, authorization: bytes | None, path: str = "/v1/models") -> int:
    sent: list[Any] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})

    async def receive() -> Any:
        return {"type": "http.request", "body": b""}

    async def send(message: Any) -> None:
        sent.append(message)

    headers = [] if authorization is None else [(b"authorization", authorization)]
    auth.app = app
    await auth({"type": "http", "method": "GET", "path": path, "headers": headers}, receive, send)
    return int(sent[0]["status"])


async def test_a_non_ascii_key_sent_as_utf_8_is_accepted() -> None:
    auth = APIKeyAuth(None, [KEY, "plain"])
    assert await status(auth, b"Bearer " + KEY.encode()) == 200
    assert await status(auth, b"bearer  " + KEY.encode() + b" ") == 200  # scheme case, spaces around
    assert await status(auth, b"Bearer plain") == 200


async def test_wrong_or_differently_encoded_keys_are_refused() -> None:
    auth = APIKeyAuth(None, [KEY])
    assert await status(auth, b"Bearer " + KEY.encode()[:-1]) == 401
    accented = APIKeyAuth(None, ["clé"])
    assert await status(accented, b"Bearer " + "clé".encode("latin-1")) == 401  # one encoding: UTF-8
    assert await status(accented, b"Bearer " + "clé".encode()) == 200
    assert await status(auth, b"Basic " + KEY.encode()) == 401
    assert await status(auth, None) == 401
    assert await status(auth, None, path="/health") == 200  # public


def test_allowed_takes_the_header_as_asgi_bytes_or_their_latin_1_decoding() -> None:
    auth = APIKeyAuth(None, [KEY])
    raw = b"Bearer " + KEY.encode()
    assert auth.allowed(raw) and auth.allowed(raw.decode("latin-1"))
    assert not auth.allowed("Bearer " + KEY[:-1])


def test_a_key_from_non_utf_8_argv_bytes_matches_those_bytes() -> None:
    key = b"k\xe9y".decode("utf-8", "surrogateescape")  # how Python hands over a latin-1 argv/env value
    assert APIKeyAuth(None, [key]).allowed(b"Bearer k\xe9y")
