"""--api-key: every route needs `Authorization: Bearer <key>` or `x-api-key: <key>` (Anthropic's header) except
/health (and /metrics with --metrics-public).

Keys are compared in constant time: the presented token and every key are hashed to equal-length digests
and all keys are compared (no early exit), so neither a key's length nor its prefix leaks through timing.
A refusal is a 401 with `WWW-Authenticate: Bearer`, in the OpenAI error shape, or in Anthropic's for a client
that speaks Anthropic's API (it sends `anthropic-version`, which that API requires, or `x-api-key`).

Keys are compared as bytes: a configured key as its UTF-8 bytes (argv and environment bytes that are not
UTF-8 come back as they were given), the header as the bytes the client sent. So a non-ASCII key works
when the client sends it UTF-8 encoded (curl, and httpx/requests given the header as bytes).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from typing import Any

from server.http.asgi import Receive, Scope, Send, send_error, send_json
from server.http.errors import APIError, anthropic_error_body
from server.http.root_path import route_path

_SCHEME = b"bearer "


def _key_bytes(key: str) -> bytes:
    try:
        return key.encode("utf-8", "surrogateescape")  # Python decodes argv and os.environ with surrogateescape
    except UnicodeEncodeError:  # a lone surrogate given in code, not from argv or the environment
        return key.encode("utf-8", "surrogatepass")


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return bytes(value)
    return None


class APIKeyAuth:
    """ASGI middleware in front of the router; lifespan events pass straight through."""

    def __init__(self, app: Any, keys: Iterable[str], *, public_paths: Iterable[str] = ("/health",)) -> None:
        self.app = app
        self._digests = [_digest(_key_bytes(k)) for k in keys]
        if not self._digests:
            raise ValueError("APIKeyAuth needs at least one key")
        self._public = frozenset(public_paths)

    def allowed(self, authorization: bytes | str | None, x_api_key: bytes | str | None = None) -> bool:
        """The headers' bytes as received (a str is taken as ASGI's latin-1 decoding of them); either may hold a key."""
        ok = False
        if isinstance(authorization, str):
            authorization = authorization.encode("latin-1", "replace")
        if authorization is not None and authorization[: len(_SCHEME)].lower() == _SCHEME:
            ok |= self._matches(authorization[len(_SCHEME) :].strip())
        if isinstance(x_api_key, str):
            x_api_key = x_api_key.encode("latin-1", "replace")
        if x_api_key is not None:
            ok |= self._matches(x_api_key.strip())
        return ok

    def _matches(self, token: bytes) -> bool:
        presented = _digest(token)
        ok = False
        for key in self._digests:  # every key, every time: the loop's length does not depend on a match
            ok |= hmac.compare_digest(presented, key)
        return ok

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and route_path(scope) not in self._public:
            x_api_key = _header(scope, b"x-api-key")
            if not self.allowed(_header(scope, b"authorization"), x_api_key):
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008})
                    return
                error = APIError(
                    "Invalid or missing API key; send `Authorization: Bearer <key>` or `x-api-key: <key>` "
                    "with a key given to the server's --api-key.",
                    status=401,
                )
                challenge = [(b"www-authenticate", b"Bearer")]
                # an Anthropic client (by its headers, not the route: the transport knows no routes) reads its own shape
                if x_api_key is not None or _header(scope, b"anthropic-version") is not None:
                    await send_json(send, 401, anthropic_error_body(401, error.message), challenge)
                else:
                    await send_error(send, error, challenge)
                return
        await self.app(scope, receive, send)
