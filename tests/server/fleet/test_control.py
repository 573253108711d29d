"""server/fleet/control.py: the owner <-> API process socket keeps frames in order, passes a Loaded frame's
descriptor with it (SCM_RIGHTS), survives any split of the byte stream, and reports the other end's exit as None."""

from __future__ import annotations

import socket
from typing import Any

import anyio
import pytest

from engine.transport.ipc import FrameEncoder
from server.fleet.control import Activity, Control, FromOwner, Loaded, Quiesce, ToOwner, Want


async def frame(control: Control) -> tuple[Any, int | None]:
    got = await control.receive()
    assert got is not None
    return got


@pytest.mark.anyio
async def test_frames_in_order_and_a_descriptor_with_its_loaded_frame() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    owner, api = Control(a.detach(), ToOwner), Control(b.detach(), FromOwner)
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)  # stands for an engine channel
    async with anyio.create_task_group() as tg:
        tg.start_soon(owner.run_writer)
        tg.start_soon(api.run_writer)
        owner.post(Quiesce("a"))
        owner.post(Loaded("b", 42), right.detach())  # handed over: closed in the sender once sent
        owner.post(Quiesce("c"))
        api.post(Want("a"))
        api.post(Activity("a", True))
        got = [await frame(api) for _ in range(3)]
        assert [(m, fd is not None) for m, fd in got] == [
            (Quiesce("a"), False),
            (Loaded("b", 42), True),
            (Quiesce("c"), False),
        ]
        fd = got[1][1]
        assert fd is not None
        with socket.socket(fileno=fd) as passed:  # the same channel: what one end sends the other receives
            left.sendall(b"ping")
            assert passed.recv(4) == b"ping"
        assert [await owner.receive() for _ in range(2)] == [(Want("a"), None), (Activity("a", True), None)]
        api.close()  # the API process exits
        assert await owner.receive() is None
        owner.post(Quiesce("d"))  # to a gone process: dropped, no error
        owner.close()
        tg.cancel_scope.cancel()
    left.close()


@pytest.mark.anyio
async def test_frames_split_at_any_byte() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    api = Control(b.detach(), FromOwner)
    data = b"".join(FrameEncoder().encode(Quiesce(name)) for name in ("x", "y"))
    for byte in data:  # one byte per write: the reader reassembles
        a.send(bytes([byte]))
    assert [await api.receive() for _ in range(2)] == [(Quiesce("x"), None), (Quiesce("y"), None)]
    a.close()
    assert await api.receive() is None
    api.close()


@pytest.mark.anyio
async def test_a_post_after_the_writer_ended_is_dropped() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    control = Control(a.detach(), ToOwner)
    with anyio.move_on_after(0.01):  # the writer task ends (as at shutdown), its queue closed
        await control.run_writer()
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    control.post(Want("a"))  # no error: a clean-up at shutdown may still report
    control.post(Loaded("a", 1), right.detach())
    assert control.eof
    left.close()
    control.close()
    b.close()
