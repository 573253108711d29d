"""GET /health (200 while the engine serves, or on `spindle render` while the renderer is up; 503 otherwise)
and GET /version.

"Serves" is the engine's heartbeat, not a live pid: the engine sends a frame at least every
heartbeat interval, and the reader marks it dead after --engine-heartbeat-timeout of silence.
503 while the model loads, while draining for shutdown, and after the engine died.
"""

from __future__ import annotations

from server.app_state import AppState
from server.http.asgi import Receive, Scope, Send, send_error
from server.http.errors import APIError
from server.http.version import send_version


class HealthRoute:
    def __init__(self, state: AppState) -> None:
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            self.state.require_renderer(count=False)  # on a full server `require`: the engine must serve too
        except APIError as e:  # every refusal here is a 503 (server/http/unavailable.py)
            await send_error(send, e)
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})


class VersionRoute:
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_version(scope, receive, send)
