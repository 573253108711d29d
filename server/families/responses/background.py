"""`background: true` responses: answered at once as `queued`, generated in a task of the serving task group
(AppState.tasks), stored when done (or `failed`).

POST /v1/responses/{id}/cancel may land on any API process: it marks the stored response `cancelled` (the
shared store, responses_store.py), which is the answer at once. The process generating it stops the generation
(the engine request is aborted as for a client gone): at once when the cancel landed on it, else when its
watcher, which reads the marks every WATCH_S while it runs background responses, sees it. The generation's end
is then not stored over the cancelled response.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from server.app_state import AppState
from server.families.responses.protocol import encoder
from server.families.responses.store import ResponseStore, StoredResponse
from server.http import unavailable
from server.http.asgi import Message, Send, send_json
from server.http.errors import APIError
from server.request.admission import AdmissionTicket

Run = Callable[[Send], Awaitable[None]]
WATCH_S = 0.1  # how often a process running background responses reads the cancel marks of other processes


async def _discard(message: Message) -> None:  # the answer goes to the store, not to a client
    return None


class BackgroundResponses:
    def __init__(self, state: AppState, store: ResponseStore) -> None:
        self.state = state
        self.store = store
        self.scopes: dict[str, anyio.CancelScope] = {}  # this process's running background responses by id
        self._watching = False

    async def start(self, base: dict[str, Any], run: Run, send: Send, ticket: AdmissionTicket | None = None) -> None:
        """Store it `queued`, start `run` in a task, answer `queued`; the task owns `ticket` (the request's
        admission ticket, detached from the route's `with` once the task is scheduled) and releases it."""
        tasks = self.state.tasks
        if tasks is None:
            raise unavailable.starting()
        queued = {
            **base,
            "status": "queued",
            "incomplete_details": None,
            "output": [],
            "output_text": "",
            "usage": None,
        }
        await self.store.put(StoredResponse(queued, []))
        scope = self.scopes[base["id"]] = anyio.CancelScope()
        tasks.start_soon(self._run, queued, scope, run, ticket.detach() if ticket is not None else None)
        if not self._watching:
            self._watching = True
            tasks.start_soon(self._watch)
        await send_json(send, 200, encoder.encode(queued))

    async def _run(
        self, queued: dict[str, Any], scope: anyio.CancelScope, run: Run, ticket: AdmissionTicket | None
    ) -> None:
        try:
            with scope:
                await run(_discard)
        except APIError as e:  # refused or failed after it was queued: the stored response says why
            await self.store.put(
                StoredResponse(
                    {**queued, "status": "failed", "error": {"code": str(e.status), "message": e.message}}, []
                )
            )
        finally:
            self.scopes.pop(queued["id"], None)
            if ticket is not None:  # generate released it already, unless it never got there
                ticket.release()

    async def _watch(self) -> None:
        """While this process runs background responses: stop those another process marked cancelled."""
        try:
            while self.scopes:
                await anyio.sleep(WATCH_S)
                for rid in await self.store.cancelled(list(self.scopes)) if self.scopes else []:
                    scope = self.scopes.pop(rid, None)
                    if scope is not None:
                        scope.cancel()
        except APIError:  # the store is unavailable: cancels from other processes wait for the next start
            pass
        finally:
            self._watching = False

    async def cancel(self, response_id: str) -> dict[str, Any]:
        entry = await self.store.get(response_id)
        if entry.response.get("background") is not True:
            raise APIError("Only responses created with background=true can be cancelled.", status=400)
        response = await self.store.cancel(response_id)
        if response is None:
            raise APIError(f"Response with id '{response_id}' not found.", status=404)
        scope = self.scopes.pop(response_id, None)
        if scope is not None and response["status"] == "cancelled":  # running here: stopped now
            scope.cancel()
        return response
