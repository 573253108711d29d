"""The Trio send fast path: bytes arrive whole and in order, a full socket or a held lock falls back to
Hypercorn's path, a broken connection is reported to the protocol as Hypercorn would."""

from __future__ import annotations

import socket

import pytest
import trio
import trio.testing
from hypercorn.events import Closed, Event, RawData

from server.http.trio_send import FastSendTCPServer

pytestmark = pytest.mark.anyio


class Protocol:
    def __init__(self) -> None:
        self.events: list[Event] = []

    async def handle(self, event: Event) -> None:
        self.events.append(event)


def make_server(sndbuf: int = 0) -> tuple[FastSendTCPServer, trio.SocketStream, Protocol]:
    a, b = socket.socketpair()
    if sndbuf:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, sndbuf)
    ours = trio.SocketStream(trio.socket.from_stdlib_socket(a))
    peer = trio.SocketStream(trio.socket.from_stdlib_socket(b))
    server = FastSendTCPServer(None, None, None, None, ours)  # type: ignore[arg-type]
    protocol = Protocol()
    server.protocol = protocol  # type: ignore[assignment]
    return server, peer, protocol


async def read_exactly(peer: trio.SocketStream, n: int) -> bytes:
    got = bytearray()
    while len(got) < n:
        chunk = await peer.receive_some(65536)
        assert chunk, "the connection closed early"
        got += chunk
    return bytes(got)


async def test_small_sends_arrive_in_order_without_yielding() -> None:
    server, peer, _ = make_server()
    payloads = [b'data: {"n":%d}\n\n' % i for i in range(50)]
    with trio.testing.assert_no_checkpoints():  # the fast path: one syscall, no trip through the scheduler
        for p in payloads:
            await server.protocol_send(RawData(data=p))
    assert await read_exactly(peer, sum(map(len, payloads))) == b"".join(payloads)


async def test_a_full_socket_falls_back_and_sends_everything() -> None:
    server, peer, _ = make_server(sndbuf=4096)
    big = bytes(range(256)) * 4096  # 1 MiB: far more than the socket takes at once
    got = b""

    async def reader() -> None:
        nonlocal got
        got = await read_exactly(peer, len(big) + 3)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        await server.protocol_send(RawData(data=big))
        await server.protocol_send(RawData(data=b"end"))
    assert got == big + b"end"


async def test_a_send_in_flight_keeps_its_place() -> None:
    server, peer, _ = make_server()
    await server.send_lock.acquire()  # another task is mid-send
    done = trio.Event()

    async def second() -> None:
        await server.protocol_send(RawData(data=b"second"))
        done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(second)
        await trio.testing.wait_all_tasks_blocked()
        assert not done.is_set()  # it waits for the lock instead of writing past it
        await server.stream.send_all(b"first,")
        server.send_lock.release()
    assert await read_exactly(peer, len(b"first,second")) == b"first,second"


async def test_a_broken_connection_is_reported_to_the_protocol() -> None:
    server, peer, protocol = make_server()
    await peer.aclose()
    await server.protocol_send(RawData(data=b"data: x\n\n"))
    assert any(isinstance(e, Closed) for e in protocol.events)
