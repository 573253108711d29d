"""One task waits, another wakes it: the cheapest such primitive on each backend, reused for every wait.

The output handler wakes each streaming route once per token. `anyio.Event` costs an Event, a
trio.Event and a ParkingLot (or an asyncio.Event) per wake-up, since events cannot be cleared;
these waiters allocate nothing per wait on Trio and one future on asyncio. Cancellation works as
for any checkpoint: a cancelled wait raises the backend's cancellation exception. `InlineWaiter` is
the direct write path's (server/http/direct_body.py): its wake-up may take the news itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

import sniffio
import trio

from server.http.direct_switch import decline


class Waiter(Protocol):
    async def wait(self) -> None: ...
    def wake(self) -> None: ...


class TrioWaiter:
    __slots__ = ("_task",)

    def __init__(self) -> None:
        self._task: trio.lowlevel.Task | None = None

    async def wait(self) -> None:
        self._task = trio.lowlevel.current_task()
        await trio.lowlevel.wait_task_rescheduled(self._abort)

    def _abort(self, _: Any) -> trio.lowlevel.Abort:
        self._task = None
        return trio.lowlevel.Abort.SUCCEEDED

    def wake(self) -> None:
        task = self._task
        if task is not None:
            self._task = None
            trio.lowlevel.reschedule(task)


class AsyncioWaiter:
    __slots__ = ("_future", "_loop")

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._future: asyncio.Future[None] | None = None

    async def wait(self) -> None:
        future = self._future = self._loop.create_future()
        try:
            await future
        finally:
            self._future = None

    def wake(self) -> None:
        future = self._future
        if future is not None and not future.done():
            future.set_result(None)


class InlineWaiter:
    """A waiter whose waker first offers the news to `take`, in the waker's own task: True means taken (the
    direct write path formatted and queued it), and the waiting task sleeps on; otherwise it is woken."""

    __slots__ = ("_inner", "_take")

    def __init__(self, take: Callable[[], bool]) -> None:
        self._inner = waiter_class()()
        self._take = take

    async def wait(self) -> None:
        await self._inner.wait()

    def wake(self) -> None:
        try:
            taken = self._take()
        except Exception as e:  # runs in the waker (the output handler): a fault declines, never raises
            decline(e)
            taken = False
        if not taken:
            self._inner.wake()


def waiter_class() -> Callable[[], Waiter]:
    """The running backend's waiter (call inside the event loop)."""
    return TrioWaiter if sniffio.current_async_library() == "trio" else AsyncioWaiter
