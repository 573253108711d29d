"""Background responses over the shared store (server/families/responses/background.py): two BackgroundResponses
on one database file stand for two API processes; a cancel sent to either stops the generation where it runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from server.app_state import AppState
from server.config import ServerConfig
from server.families.responses.background import BackgroundResponses
from server.families.responses.store import ResponseStore, StoredResponse
from server.http.asgi import Message, Send
from server.http.errors import APIError
from server.request.admission import Admission, AdmissionTicket

pytestmark = pytest.mark.anyio


class Generation:
    """A background run that waits until cancelled (nothing ends it otherwise) and says it was."""

    def __init__(self) -> None:
        self.started, self.cancelled = anyio.Event(), anyio.Event()

    async def __call__(self, send: Send) -> None:
        self.started.set()
        try:
            await anyio.sleep_forever()
        finally:
            self.cancelled.set()


async def _answer(message: Message) -> None:
    return None


def process(tasks: Any, directory: Path) -> BackgroundResponses:
    state = AppState(config=ServerConfig(), model_name="m")
    state.tasks = tasks
    return BackgroundResponses(state, ResponseStore(8, str(directory)))


@pytest.mark.parametrize("cancel_on", ["owner", "other"])
async def test_a_cancel_on_either_process_stops_the_generation(tmp_path: Path, cancel_on: str) -> None:
    async with anyio.create_task_group() as tasks:
        owner, other = process(tasks, tmp_path), process(tasks, tmp_path)
        gen = Generation()
        await owner.start({"id": "resp_1", "background": True}, gen, _answer)
        await gen.started.wait()
        assert (await other.store.get("resp_1")).response["status"] == "queued"
        got = await (owner if cancel_on == "owner" else other).cancel("resp_1")
        assert got["status"] == "cancelled"
        with anyio.fail_after(30):  # the owner stops it: at once, or when its watcher reads the mark
            await gen.cancelled.wait()
        assert not await owner.store.put(StoredResponse({"id": "resp_1", "status": "completed"}, []))
        for p in (owner, other):
            assert (await p.store.get("resp_1")).response["status"] == "cancelled"
        tasks.cancel_scope.cancel()


async def test_only_background_responses_can_be_cancelled(tmp_path: Path) -> None:
    p = process(None, tmp_path)
    await p.store.put(StoredResponse({"id": "resp_2", "status": "completed", "background": False}, []))
    with pytest.raises(APIError) as e:
        await p.cancel("resp_2")
    assert e.value.status == 400
    with pytest.raises(APIError) as e:
        await p.cancel("resp_none")
    assert e.value.status == 404


async def test_the_task_owns_the_admission_ticket_once_started(tmp_path: Path) -> None:
    """The route's `with` ends once `queued` is answered; the ticket stays held until the generation ends."""
    admission = Admission(max_num_queued_reqs=4, max_num_queued_tokens=None)
    async with anyio.create_task_group() as tasks:
        owner = process(tasks, tmp_path)
        gen = Generation()
        with AdmissionTicket(admission) as ticket:
            assert ticket.resize(1, 7) is None
            await owner.start({"id": "resp_3", "background": True}, gen, _answer, ticket)
        await gen.started.wait()
        assert (admission.queued_reqs, admission.queued_tokens) == (1, 7)
        await owner.cancel("resp_3")
        with anyio.fail_after(30):
            await gen.cancelled.wait()
        await anyio.wait_all_tasks_blocked()
        assert (admission.queued_reqs, admission.queued_tokens) == (0, 0)
        tasks.cancel_scope.cancel()
