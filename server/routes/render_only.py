"""What `spindle render` answers where the full server would generate: a 404 naming `spindle serve` (the paths
are the route table's that need an engine, server/routes/table.py)."""

from __future__ import annotations

from server.http.asgi import Receive, Scope, Send, no_route, send_error
from server.http.errors import APIError


class NotHereRoute:
    """A generation route on the render-only server: 404 saying where it is served."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_error(
            send,
            APIError(
                f"{scope['path']} is not served here: this is a render-only server (`spindle render`), which "
                "tokenizes and renders prompts but runs no model; send generation requests to a `spindle serve` "
                "server.",
                status=404,
            ),
        )


not_found = no_route(
    " on this render-only server; see /tokenize, /detokenize, /v1/completions/render, /v1/chat/completions/render, "
    "/v1/models."
)
