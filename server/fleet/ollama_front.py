"""Ollama's model routes on the --models-dir front: every model in /api/tags, the loaded ones in /api/ps, and
/api/version as a single server answers it (the rest of Ollama's API names its model: routed)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from starlette.routing import Route

from server.families.ollama.info import OllamaVersionRoute, listed, running
from server.families.ollama.protocol import encoder
from server.fleet.loaded_set import ModelRegistry, ModelSlot
from server.http.asgi import Receive, Scope, Send, send_json


class _Endpoint:
    """A raw ASGI endpoint (an instance: Starlette calls a plain function with a Request)."""

    def __init__(self, handle: Callable[[Send], Awaitable[None]]) -> None:
        self.handle = handle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.handle(send)


def _unloads_at(registry: ModelRegistry, slot: ModelSlot) -> float | None:
    """The wall-clock time the model unloads if no request comes (None: never by idleness); busy, from now."""
    limit = registry.idle_limit(slot)
    if limit is None:
        return None
    now = anyio.current_time()
    return time.time() + (now if slot.busy else slot.last_used) - now + limit


def ollama_routes(registry: ModelRegistry) -> list[Route]:
    async def tags(send: Send) -> None:
        models = [await listed(name, str(slot.entry.path)) for name, slot in sorted(registry.slots.items())]
        await send_json(send, 200, encoder.encode({"models": models}))

    async def ps(send: Send) -> None:
        models: list[dict[str, Any]] = []
        for name, slot in sorted(registry.slots.items()):
            limits = slot.loaded.state.limits if slot.loaded is not None else None
            if slot.status == "loaded" and limits is not None:
                entry = await listed(name, str(slot.entry.path))
                models.append(running(entry, limits.max_model_len, _unloads_at(registry, slot)))
        await send_json(send, 200, encoder.encode({"models": models}))

    return [
        Route("/api/tags", _Endpoint(tags), methods=["GET"]),
        Route("/api/ps", _Endpoint(ps), methods=["GET"]),
        Route("/api/version", OllamaVersionRoute(), methods=["GET"]),
    ]
