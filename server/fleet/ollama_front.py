"""Ollama's model routes on the --models-dir front: every model in /api/tags, the loaded ones in /api/ps, and
/api/version as a single server answers it (the rest of Ollama's API names its model: routed)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from starlette.routing import Route

from server.families.ollama.info import OllamaVersionRoute, listed, running
from server.families.ollama.protocol import encoder
from server.fleet.loaded_set import ModelRegistry
from server.http.asgi import Receive, Scope, Send, send_json


class _Endpoint:
    """A raw ASGI endpoint (an instance: Starlette calls a plain function with a Request)."""

    def __init__(self, handle: Callable[[Send], Awaitable[None]]) -> None:
        self.handle = handle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.handle(send)


def ollama_routes(registry: ModelRegistry) -> list[Route]:
    async def tags(send: Send) -> None:
        models = [await listed(name, str(slot.entry.path)) for name, slot in sorted(registry.slots.items())]
        await send_json(send, 200, encoder.encode({"models": models}))

    async def ps(send: Send) -> None:
        models: list[dict[str, Any]] = []
        for name, slot in sorted(registry.slots.items()):
            limits = slot.loaded.state.limits if slot.loaded is not None else None
            if slot.status == "loaded" and limits is not None:
                models.append(running(await listed(name, str(slot.entry.path)), limits.max_model_len))
        await send_json(send, 200, encoder.encode({"models": models}))

    return [
        Route("/api/tags", _Endpoint(tags), methods=["GET"]),
        Route("/api/ps", _Endpoint(ps), methods=["GET"]),
        Route("/api/version", OllamaVersionRoute(), methods=["GET"]),
    ]
