"""Direct body writes under real Hypercorn (Trio and asyncio workers): valid chunked framing in order
with ASGI sends, a slow client turns them off until Hypercorn's path has flushed, HTTP/1.0 and plain
Hypercorn (no install) go through ASGI only."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import h11
import pytest
from hypercorn.asyncio import run as hypercorn_asyncio_run
from hypercorn.config import Config
from hypercorn.trio import run as hypercorn_trio_run

from server.http import direct_body, direct_switch

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["trio", "asyncio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def installed(anyio_backend: str) -> Iterator[None]:
    module: Any = hypercorn_trio_run if anyio_backend == "trio" else hypercorn_asyncio_run
    before = module.TCPServer
    assert direct_body.install(anyio_backend)
    assert direct_body.install(anyio_backend)  # idempotent
    try:
        yield
    finally:
        module.TCPServer = before


class App:
    """Streams `chunks`: directly while the writer takes them, else flush and ASGI send."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks
        self.had_writer = False
        self.direct_writes = 0
        self.declined = anyio.Event()  # set when the writer first declined (the client fell behind)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        await receive()
        batch = direct_body.WriteBatch()
        direct = direct_body.for_current_request(batch)
        self.had_writer = direct is not None
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        for chunk in self.chunks:
            if direct is not None and direct.send(chunk):
                batch.flush()
                self.direct_writes += 1
                continue
            self.declined.set()
            if direct is not None:
                await direct.flush()
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        self.declined.set()  # (also when it never declined: the client then reads, and the test fails)
        if direct is not None:
            await direct.flush()
        await send({"type": "http.response.body", "body": b"end", "more_body": False})


@pytest.fixture
async def serve(anyio_backend: str) -> AsyncIterator[Any]:
    """serve(app) -> the port of a real Hypercorn worker on a socket already listening (no wait for bind)."""
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:

        async def start(app: App) -> int:
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sock.listen(16)
            port = int(sock.getsockname()[1])
            config = Config()
            config.bind = [f"fd://{sock.detach()}"]  # Hypercorn owns (and closes) it from here
            config.accesslog = None
            if anyio_backend == "trio":
                from hypercorn.trio import serve as hc_serve
            else:
                from hypercorn.asyncio import serve as hc_serve  # type: ignore[assignment]
            tg.start_soon(lambda: hc_serve(app, config, shutdown_trigger=stop.wait))  # type: ignore[arg-type]
            return port

        yield start
        stop.set()


async def fetch(port: int, *, after: anyio.Event | None = None) -> bytes:
    """GET / over HTTP/1.1, parsed by h11 (so bad chunk framing fails); reading starts after `after`."""
    client = h11.Connection(h11.CLIENT)
    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
        await stream.send(client.send(h11.Request(method="GET", target="/", headers=[("host", "x")])))
        await stream.send(client.send(h11.EndOfMessage()))
        if after is not None:
            await after.wait()
        body = bytearray()
        while True:
            event = client.next_event()
            if event is h11.NEED_DATA:
                client.receive_data(await stream.receive(1 << 20))
            elif isinstance(event, h11.Response):
                assert event.status_code == 200
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                return bytes(body)


async def test_chunks_go_direct_and_arrive_framed_in_order(installed: None, serve: Any) -> None:
    chunks = [b'data: {"n":%d}\n\n' % i for i in range(200)]
    app = App(chunks)
    port = await serve(app)
    assert await fetch(port) == b"".join(chunks) + b"end"
    assert app.had_writer and app.direct_writes == len(chunks)  # a reading client: every one direct
    assert await fetch(port) == b"".join(chunks) + b"end"  # keep-alive's next request on a new connection too


async def test_a_client_that_stops_reading_turns_direct_writes_off(installed: None, serve: Any) -> None:
    chunks = [b"%07d;" % i * 8192 for i in range(2000)]  # 64 KiB each: far more than socket buffers hold
    app = App(chunks)
    port = await serve(app)
    assert await fetch(port, after=app.declined) == b"".join(chunks) + b"end"
    assert 0 < app.direct_writes < len(chunks)


async def test_http_1_0_is_not_chunked_so_it_goes_through_asgi(installed: None, serve: Any) -> None:
    chunks = [b"one;", b"two;"]
    app = App(chunks)
    port = await serve(app)
    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
        await stream.send(b"GET / HTTP/1.0\r\n\r\n")
        raw = bytearray()
        with pytest.raises(anyio.EndOfStream):
            while True:
                raw += await stream.receive()
    head, _, body = bytes(raw).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and body == b"one;two;end"  # close-delimited: no chunk sizes
    assert app.had_writer and app.direct_writes == 0


async def test_without_install_there_is_no_writer(serve: Any, anyio_backend: str) -> None:
    module: Any = hypercorn_trio_run if anyio_backend == "trio" else hypercorn_asyncio_run
    assert module.TCPServer.__module__.startswith("hypercorn")  # plain `hypercorn ...`
    app = App([b"a", b"b"])
    port = await serve(app)
    assert await fetch(port) == b"abend"
    assert not app.had_writer


def test_install_refuses_an_unknown_layout() -> None:
    before = hypercorn_trio_run.TCPServer
    try:
        hypercorn_trio_run.TCPServer = object  # type: ignore[misc,assignment]
        assert not direct_body.install("trio")
        assert hypercorn_trio_run.TCPServer is object
    finally:
        hypercorn_trio_run.TCPServer = before  # type: ignore[misc]


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast path on, as at process start (a test that declines it turns it back on after)."""
    monkeypatch.setattr(direct_switch, "_active", True)


class _Lock:
    def locked(self) -> bool:
        return False


class _NoProtocol:
    """A Trio TCPServer from a Hypercorn that renamed `protocol`: everything else is there."""

    send_lock = _Lock()
    stream: Any = None


def test_a_server_without_an_expected_attribute_declines_and_warns_once(
    fresh: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import trio

    run_module: Any = hypercorn_trio_run
    monkeypatch.setattr(run_module, "TCPServer", run_module.TCPServer)  # put back after
    assert direct_body.install("trio")  # the layout, as `spindle serve` has it
    server = _NoProtocol()
    server.stream = object.__new__(trio.SocketStream)  # a plain TCP stream: send() goes on to h11's state
    batch = direct_body.WriteBatch()
    with caplog.at_level("WARNING", logger="spindle.server"):
        body = direct_body._TrioBody(server, batch)
        assert body.send(b"data: x\n\n") is False  # not raised: declined
        assert body.send(b"data: y\n\n") is False
        token = direct_body._connection.set((direct_body._TrioBody, server))
        try:
            assert direct_body.for_current_request(batch) is None  # off for every later response
        finally:
            direct_body._connection.reset(token)
    warnings = [r for r in caplog.records if "turned off" in r.getMessage()]
    assert len(warnings) == 1 and "AttributeError" in warnings[0].getMessage()
    assert not direct_switch.is_active()
    batch.flush()  # nothing was taken


def test_a_server_missing_what_the_writer_needs_at_start_gets_no_writer(
    fresh: None, caplog: pytest.LogCaptureFixture
) -> None:
    token = direct_body._connection.set((direct_body._AsyncioBody, object()))  # no send_lock, no writer
    try:
        with caplog.at_level("WARNING", logger="spindle.server"):
            assert direct_body.for_current_request(direct_body.WriteBatch()) is None
            assert direct_body.for_current_request(direct_body.WriteBatch()) is None
    finally:
        direct_body._connection.reset(token)
    assert len([r for r in caplog.records if "turned off" in r.getMessage()]) == 1


class Recorder(direct_body.DirectBody):
    """A response whose connection always takes a direct write; `_put` records what was written."""

    def __init__(self, batch: direct_body.WriteBatch, fail: bool = False) -> None:
        super().__init__(_NoProtocol(), batch)
        self.writes: list[bytes] = []
        self.fail = fail

    def _transport_idle(self) -> bool:
        return True

    def _h11_sends_chunks(self) -> bool:
        return True

    def _put(self, frame: bytes) -> None:
        if self.fail:
            raise AttributeError("no write_now")
        self.writes.append(frame)


def test_write_batch_writes_nothing_until_flush_then_each_response_once(fresh: None) -> None:
    batch = direct_body.WriteBatch()
    a, b = Recorder(batch), Recorder(batch)
    assert a.send(b"1") and b.send(b"2")
    assert a.writes == [] and b.writes == []
    batch.flush()
    assert a.writes == [b"1\r\n1\r\n"] and b.writes == [b"1\r\n2\r\n"]
    batch.flush()  # emptied: nothing is written twice
    assert len(a.writes) == 1 and len(b.writes) == 1


def test_a_failed_write_keeps_the_frame_for_hypercorns_path(fresh: None) -> None:
    batch = direct_body.WriteBatch()
    body = Recorder(batch, fail=True)
    assert body.send(b"abc")
    batch.flush()  # runs in the writer task: must not raise
    assert body.pending == b"3\r\nabc\r\n"  # for the route's flush through Hypercorn
    assert not direct_switch.is_active()
    assert not body.send(b"d")  # off: the route sends it


def test_a_chunk_before_the_writer_ran_writes_the_last_one_first(fresh: None) -> None:
    """At most one chunk per response waits for the writer: a full socket then shows before the next is
    taken (the route merges what follows, as a slow client needs)."""
    batch = direct_body.WriteBatch()
    body = Recorder(batch)
    assert body.send(b"x") and body.send(b"y")
    assert body.writes == [b"1\r\nx\r\n"]  # written when "y" came; "y" waits
    batch.flush()
    assert body.writes == [b"1\r\nx\r\n", b"1\r\ny\r\n"]

    class Full(Recorder):
        def _put(self, frame: bytes) -> None:
            self.writes.append(frame)
            self.pending += frame[3:]  # the socket took three bytes

    full = Full(batch)
    assert full.send(b"abc")
    assert not full.send(b"d")  # "abc" written now, the socket is full: "d" goes through the route
    assert full.writes == [b"3\r\nabc\r\n"] and full.pending == b"abc\r\n"


async def test_the_writer_task_writes_once_the_producer_yields_and_a_route_writes_its_own_first(fresh: None) -> None:
    batch = direct_body.WriteBatch()
    a, b = Recorder(batch), Recorder(batch)

    async def no_flush_needed() -> None:
        pass

    async with anyio.create_task_group() as tg:
        tg.start_soon(batch.run)
        while not batch.running:
            await anyio.lowlevel.checkpoint()
        assert a.send(b"x") and b.send(b"y")
        assert a.writes == [] and b.writes == []  # the producer has not yielded yet
        b.flush = no_flush_needed  # type: ignore[method-assign]
        await a.flush()  # a route about to send through ASGI: its own queued frames go first, now
        assert a.writes == [b"1\r\nx\r\n"] and b.writes == []
        with anyio.fail_after(5):
            while not b.writes:  # the writer runs once this task yields
                await anyio.lowlevel.checkpoint()
        assert b.writes == [b"1\r\ny\r\n"] and len(a.writes) == 1  # the writer ran: b's, and a's not again
        batch.stop()
    assert not batch.running


async def test_a_writer_stopped_before_it_started_does_not_start() -> None:
    batch = direct_body.WriteBatch()
    batch.stop()
    with anyio.fail_after(5):
        await batch.run()
    assert not batch.running


def test_without_a_running_writer_a_request_gets_no_direct_body(fresh: None) -> None:
    token = direct_body._connection.set((Recorder, _NoProtocol()))
    try:
        assert direct_body.for_current_request() is None  # install() gave no batch, or its writer is not running
    finally:
        direct_body._connection.reset(token)


def test_spindle_direct_write_0_installs_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPINDLE_DIRECT_WRITE", "0")
    run_module: Any = hypercorn_trio_run
    before = run_module.TCPServer
    assert not direct_body.install("trio")
    assert run_module.TCPServer is before


def test_install_declines_when_a_private_module_is_missing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "h11._writers", None)  # import fails, as if h11 moved it
    run_module: Any = hypercorn_asyncio_run
    before = run_module.TCPServer
    with caplog.at_level("WARNING", logger="spindle.server"):
        assert not direct_body.install("asyncio")
    assert run_module.TCPServer is before
    assert any("unknown layout" in r.getMessage() for r in caplog.records)
