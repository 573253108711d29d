"""`background: true` responses: answered at once as `queued`, generated in a task of the serving task group
(AppState.tasks), stored when done (or `failed`); POST /v1/responses/{id}/cancel cancels the generation (the
engine request is aborted as for a client gone) and stores it as `cancelled`. Per API process, as the store."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from server.api.openai.responses_store import ResponseStore, StoredResponse
from server.api.state import AppState
from server.http.asgi import Message, Send, send_json
from server.http.errors import APIError
from server.pipeline import unavailable
from server.protocol.responses import encoder

Run = Callable[[Send], Awaitable[None]]


async def _discard(message: Message) -> None:  # the answer goes to the store, not to a client
    return None


class BackgroundResponses:
    def __init__(self, state: AppState, store: ResponseStore) -> None:
        self.state = state
        self.store = store
        self.scopes: dict[str, anyio.CancelScope] = {}  # running background responses by id

    async def start(self, base: dict[str, Any], run: Run, send: Send) -> None:
        tasks = self.state.tasks
        if tasks is None:
            raise unavailable.starting()
        queued = {**base, "status": "queued", "incomplete_details": None, "output": [], "output_text": "",
                  "usage": None}
        self.store.put(StoredResponse(queued, []))
        scope = self.scopes[base["id"]] = anyio.CancelScope()
        tasks.start_soon(self._run, queued, scope, run)
        await send_json(send, 200, encoder.encode(queued))

    async def _run(self, queued: dict[str, Any], scope: anyio.CancelScope, run: Run) -> None:
        try:
            with scope:
                await run(_discard)
        except APIError as e:  # refused or failed after it was queued: the stored response says why
            self.store.put(StoredResponse({**queued, "status": "failed",
                                           "error": {"code": str(e.status), "message": e.message}}, []))
        finally:
            self.scopes.pop(queued["id"], None)

    def cancel(self, response_id: str) -> dict[str, Any]:
        entry = self.store.get(response_id)
        if entry.response.get("background") is not True:
            raise APIError("Only responses created with background=true can be cancelled.", status=400)
        scope = self.scopes.pop(response_id, None)
        if scope is not None:
            scope.cancel()
            entry.response = {**entry.response, "status": "cancelled"}
        return entry.response
