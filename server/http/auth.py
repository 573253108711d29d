"""--api-key: every route needs `Authorization: Bearer <key>` except /health (and /metrics with --metrics-public).

Keys are compared in constant time: the presented token and every key are hashed to equal-length digests
and all keys are compared (no early exit), so neither a key's length nor its prefix leaks through timing.
A refusal is a 401 in the OpenAI error shape with `WWW-Authenticate: Bearer`.

Keys are compared as bytes: a configured key as its UTF-8 bytes (argv and environment bytes that are not
UTF-8 come back as they were given), the header as the bytes the client sent. So a non-ASCII key works
when the client sends it UTF-8 encoded (curl, and httpx/requests given the header as bytes).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from typing import Any

from server.http.asgi import Receive, Scope, Send, send_error
from server.http.errors import APIError

_SCHEME = b"bearer "


def _key_bytes(key: str) -> bytes:
    try:
        return key.encode("utf-8", "surrogateescape")  # Python decodes argv and os.environ with surrogateescape
    except UnicodeEncodeError:  # a lone surrogate given in code, not from argv or the environment
        return key.encode("utf-8", "surrogatepass")


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


def _authorization(scope: Scope) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == b"authorization":
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

    def allowed(self, authorization: bytes | str | None) -> bool:
        """`authorization`: the header's bytes as received (a str is taken as ASGI's latin-1 decoding of them)."""
        if isinstance(authorization, str):
            authorization = authorization.encode("latin-1", "replace")
        if authorization is None or authorization[: len(_SCHEME)].lower() != _SCHEME:
            return False
        presented = _digest(authorization[len(_SCHEME):].strip())
        ok = False
        for key in self._digests:  # every key, every time: the loop's length does not depend on a match
            ok |= hmac.compare_digest(presented, key)
        return ok

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and scope["path"] not in self._public:
            if not self.allowed(_authorization(scope)):
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008})
                    return
                await send_error(send, APIError("Invalid or missing API key; send `Authorization: Bearer <key>` "
                                                "with a key given to the server's --api-key.", status=401),
                                 [(b"www-authenticate", b"Bearer")])
                return
        await self.app(scope, receive, send)
