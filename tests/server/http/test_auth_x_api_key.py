"""x-api-key (Anthropic's header) carries the same keys as `Authorization: Bearer`, compared the same way."""

from __future__ import annotations

import json
from typing import Any

import pytest

from server.http.auth import APIKeyAuth

pytestmark = pytest.mark.anyio

KEY = "clé-ключ-🔑"


async def call(auth: APIKeyAuth, headers: list[tuple[bytes, bytes]]) -> tuple[int, Any]:
    sent: list[Any] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def receive() -> Any:
        return {"type": "http.request", "body": b""}

    async def send(message: Any) -> None:
        sent.append(message)

    auth.app = app
    await auth({"type": "http", "method": "POST", "path": "/v1/messages", "headers": headers}, receive, send)
    return int(sent[0]["status"]), json.loads(sent[1]["body"])


async def test_x_api_key_is_accepted_with_the_same_keys() -> None:
    auth = APIKeyAuth(None, [KEY, "plain"])
    assert (await call(auth, [(b"x-api-key", KEY.encode())]))[0] == 200
    assert (await call(auth, [(b"X-Api-Key", b" plain ")]))[0] == 200
    assert (await call(auth, [(b"x-api-key", b"wrong"), (b"authorization", b"Bearer plain")]))[0] == 200  # either
    assert (await call(auth, [(b"x-api-key", b"plain"), (b"authorization", b"Bearer wrong")]))[0] == 200


async def test_refusals_take_the_shape_of_the_client() -> None:
    auth = APIKeyAuth(None, ["k"])
    status, body = await call(auth, [(b"x-api-key", b"wrong")])
    assert status == 401 and body["type"] == "error" and body["error"]["type"] == "authentication_error"
    status, body = await call(auth, [(b"anthropic-version", b"2023-06-01")])
    assert status == 401 and body["error"]["type"] == "authentication_error"
    status, body = await call(auth, [(b"authorization", b"Bearer wrong")])
    assert status == 401 and body["error"]["code"] == 401 and "type" not in body  # OpenAI's shape


def test_allowed_takes_either_header() -> None:
    auth = APIKeyAuth(None, [KEY])
    assert auth.allowed(None, KEY.encode()) and auth.allowed(None, KEY.encode().decode("latin-1"))
    assert not auth.allowed(None, KEY.encode()[:-1]) and not auth.allowed(None, None)
    assert not auth.allowed(None, b"Bearer " + KEY.encode())  # x-api-key holds the bare key
