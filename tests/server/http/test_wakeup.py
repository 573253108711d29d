"""The per-backend waiter: wake releases the waiting task, reuse works, a cancelled wait leaves no trace; the
inline waiter wakes only when its take declines."""

from __future__ import annotations

import anyio
import anyio.lowlevel
import pytest
from anyio import wait_all_tasks_blocked

from server.http import direct_switch
from server.http.wakeup import AsyncioWaiter, InlineWaiter, TrioWaiter, waiter_class

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["trio", "asyncio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def test_the_backends_own_waiter_is_chosen(anyio_backend: str) -> None:
    assert waiter_class() is (TrioWaiter if anyio_backend == "trio" else AsyncioWaiter)


async def test_wake_releases_the_waiter_every_time() -> None:
    waiter = waiter_class()()
    rounds = 0
    async with anyio.create_task_group() as tg:

        async def waiting() -> None:
            nonlocal rounds
            for _ in range(100):
                await waiter.wait()
                rounds += 1

        tg.start_soon(waiting)
        for i in range(100):
            await wait_all_tasks_blocked()
            assert rounds == i  # blocked until woken
            waiter.wake()
            waiter.wake()  # a second wake for the same wait changes nothing
    assert rounds == 100


async def test_wake_without_a_waiter_is_not_remembered() -> None:
    waiter = waiter_class()()
    waiter.wake()  # nobody waits: the caller checks its condition first, so a stale wake must be no wake
    returned = False

    async def waiting() -> None:
        nonlocal returned
        await waiter.wait()
        returned = True

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiting)
        await wait_all_tasks_blocked()
        assert not returned
        tg.cancel_scope.cancel()


async def test_a_cancelled_wait_is_forgotten() -> None:
    waiter = waiter_class()()
    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter.wait)
        await wait_all_tasks_blocked()
        tg.cancel_scope.cancel()
    # nothing of the cancelled wait is kept: a wake has nobody to touch (on Trio, rescheduling the
    # cancelled task would crash the run; on asyncio a kept future would swallow the next wake-up)
    assert (waiter._task if isinstance(waiter, TrioWaiter) else waiter._future) is None  # type: ignore[union-attr]
    waiter.wake()
    await anyio.lowlevel.checkpoint()
    # and the waiter still works: a new wait is released by the next wake, and only by it
    released = anyio.Event()

    async def waiting() -> None:
        await waiter.wait()
        released.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiting)
        await wait_all_tasks_blocked()
        assert not released.is_set()  # the wake above, given while nobody waited, was not remembered
        waiter.wake()
        with anyio.fail_after(5):
            await released.wait()


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """The direct write path on, as at process start (a test that declines it turns it back on after)."""
    monkeypatch.setattr(direct_switch, "_active", True)


async def test_an_inline_waiter_wakes_the_waiting_task_only_when_take_declines(fresh: None) -> None:
    answers = [True, False, True]
    taken: list[bool] = []

    def take() -> bool:
        taken.append(answers[len(taken)])
        return taken[-1]

    waiter = InlineWaiter(take)
    woken = 0
    async with anyio.create_task_group() as tg:

        async def waiting() -> None:
            nonlocal woken
            while True:
                await waiter.wait()
                woken += 1

        tg.start_soon(waiting)
        for expected in (0, 1, 1):
            await wait_all_tasks_blocked()
            waiter.wake()
            await wait_all_tasks_blocked()
            assert woken == expected
        tg.cancel_scope.cancel()
    assert taken == answers


async def test_an_inline_waiter_whose_take_raises_wakes_and_turns_the_direct_path_off(fresh: None) -> None:
    def take() -> bool:
        raise AttributeError("a transport without the expected attribute")

    waiter = InlineWaiter(take)
    released = anyio.Event()

    async def waiting() -> None:
        await waiter.wait()
        released.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiting)
        await wait_all_tasks_blocked()
        waiter.wake()  # runs in the waker (the output handler): must not raise
        with anyio.fail_after(5):
            await released.wait()
    assert not direct_switch.is_active()
