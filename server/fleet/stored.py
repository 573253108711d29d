"""GET / DELETE /v1/responses/{id} and POST /v1/responses/{id}/cancel behind --models-dir: these name no model, so
the front finds the model whose Responses store holds the id. Each model's store is kept here, by model name, for
the server's life: a model's stored responses outlive its unload (its app is given the same store at each load)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from server.families.responses.store import DEFAULT_MAX_BYTES, ResponseStore, not_found
from server.fleet.catalog import ModelEntry
from server.http.asgi import Receive, Scope, Send, send_error, send_json
from server.http.errors import APIError

_encoder = msgspec.json.Encoder()


class ModelStores:
    def __init__(
        self, entries: dict[str, ModelEntry], size: int, shared: str | None = None, max_bytes: int = DEFAULT_MAX_BYTES
    ) -> None:
        """shared: --api-server-count's folder (server/runtime/launcher.py): each model's store is a file in a
        folder of its own there, one for all API processes; None: in memory. size and max_bytes: each model's
        own unless models.yaml gives it others."""
        self.stores = {
            name: ResponseStore(
                int(entry.settings.get("responses_store_size", size)),
                _folder(shared, name),
                int(entry.settings.get("responses_store_max_bytes", max_bytes)),
            )
            for name, entry in entries.items()
        }

    async def owner(self, response_id: str) -> str | None:
        """The model whose store holds `response_id` (None: no store does)."""
        for name, store in self.stores.items():
            try:
                await store.get(response_id)
            except APIError as e:
                if e.status != 404:
                    raise
                continue
            return name
        return None

    async def answer(self, name: str, scope: Scope, receive: Receive, send: Send) -> None:
        """GET or DELETE of a stored response from its model's store (no engine needed: the model may be unloaded)."""
        store, response_id = self.stores[name], scope["path_params"]["response_id"]
        try:
            if scope["method"] == "DELETE":
                await store.delete(response_id)
                body: Any = {"id": response_id, "object": "response.deleted", "deleted": True}
            else:
                body = (await store.get(response_id)).response
        except APIError as e:
            await send_error(send, e)
            return
        await send_json(send, 200, _encoder.encode(body))


def _folder(shared: str | None, name: str) -> str | None:
    if shared is None:
        return None
    folder = Path(shared) / name
    folder.mkdir(mode=0o700, exist_ok=True)
    return str(folder)


def unknown(response_id: str) -> APIError:
    """No model's store holds it: the 404 a single server gives."""
    return not_found(response_id)
