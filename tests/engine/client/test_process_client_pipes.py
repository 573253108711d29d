"""EngineClient's pipes under pressure, with in-memory pipes standing in for the subprocess's.

The stdin "pipe" takes bytes only when the test reads them (an engine that stopped reading), and the
stdout "pipe" gives only what the test writes, so the writer task, the queue and the AsyncLLM output
handler can be driven into the states that tore frames or deadlocked before. The real engine process
behind real pipes is tests/engine/client/test_process_client.py and tests/e2e.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
from anyio.streams.stapled import StapledByteStream

from engine.client.process_client import EngineClient, OwnedEngine
from engine.messages import (
    AbortRequests,
    AddRequest,
    EngineStats,
    FromEngine,
    Heartbeat,
    Ready,
    RequestOutput,
    SamplingParams,
    StepOutputs,
    ToEngine,
)
from engine.transport.ipc import FrameBuffer, FrameEncoder

pytestmark = pytest.mark.anyio
STATS = EngineStats(0, 0, 0, 10, 0, 0, 0)
READY = Ready(
    max_model_len=4096, vocab_size=151_646, eos_token_ids=[151645], num_blocks=10, block_size=16, model_dtype="float32"
)


@pytest.fixture(params=["trio", "asyncio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param  # type: ignore[no-any-return]


class _Stdin:
    """A pipe of `capacity` bytes that the 'engine' (the test) drains with `read`."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.buffer = bytearray()
        self.room = anyio.Event()
        self.writes = 0

    async def send(self, data: bytes) -> None:
        self.writes += 1
        view = memoryview(data)
        while view:  # partial writes, like a real pipe: a cancel here would tear a frame
            room = self.capacity - len(self.buffer)
            if room <= 0:
                self.room = anyio.Event()
                await self.room.wait()
                continue
            self.buffer += view[:room]
            view = view[room:]
            await anyio.lowlevel.checkpoint()

    def read(self) -> bytes:
        data, self.buffer = bytes(self.buffer), bytearray()
        self.room.set()
        return data

    async def aclose(self) -> None:
        pass


class _Stdout:
    def __init__(self) -> None:
        self.send, self.recv = anyio.create_memory_object_stream[bytes](0)

    async def receive(self, max_bytes: int = 65536) -> bytes:
        return await self.recv.receive()


class FakeProcess:
    def __init__(self, capacity: int) -> None:
        self.stdin = _Stdin(capacity)
        self.stdout = _Stdout()
        self.pid = 0
        self.returncode: int | None = None

    async def wait(self) -> int:
        self.returncode = 0
        return 0

    def kill(self) -> None:
        self.returncode = -9

    async def aclose(self) -> None:
        pass


@asynccontextmanager
async def client(
    capacity: int = 1 << 20, heartbeat_timeout: float = 30.0
) -> AsyncIterator[tuple[EngineClient, FakeProcess]]:
    proc = FakeProcess(capacity)
    c = EngineClient(
        StapledByteStream(proc.stdin, proc.stdout),
        OwnedEngine(proc),  # type: ignore[arg-type]
        READY,
        FrameBuffer(FromEngine),
        heartbeat_timeout,
    )
    async with anyio.create_task_group() as tg:
        await tg.start(c._write_loop)
        yield c, proc
        tg.cancel_scope.cancel()


async def drain(c: EngineClient, proc: FakeProcess) -> bytes:
    """Read the stdin pipe like an engine until the writer has nothing left."""
    received = bytearray()
    while True:
        await anyio.wait_all_tasks_blocked()
        chunk = proc.stdin.read()
        if not chunk and not c.queued:
            return bytes(received)
        received += chunk


def frames(data: bytes) -> list[Any]:
    return FrameBuffer[ToEngine](ToEngine).feed(data)


CANCELLED = 12  # senders cancelled mid-write (asyncio reads the 1000-byte stand-in pipe slowly: ~1 s each)


def add(rid: str, n: int = 3500) -> AddRequest:
    return AddRequest(rid, list(range(n)), SamplingParams(max_tokens=8), time.time())


async def test_callers_cancelled_at_any_point_never_cut_a_frame() -> None:
    """Big prompts whose senders are cancelled mid-way through a write still arrive as whole frames."""
    async with client(capacity=1000) as (c, proc):
        received = bytearray()
        for i in range(CANCELLED):
            with anyio.CancelScope() as scope:
                c.add_request(add(f"r{i}"))
                scope.cancel()  # the HTTP request vanished right after queueing
                await anyio.lowlevel.checkpoint()
            received += proc.stdin.read()  # the engine reads part of a frame now and then
        received += await drain(c, proc)
        got = frames(bytes(received))
        assert [m.request_id for m in got] == [f"r{i}" for i in range(CANCELLED)]
        assert all(len(m.prompt_token_ids) == 3500 for m in got)


async def test_abort_of_a_queued_add_drops_it_and_an_abort_never_overtakes_its_add() -> None:
    async with client(capacity=10) as (c, proc):
        # small prompts: ordering is the point, and each 10-byte read costs the engine stand-in a round
        c.add_request(add("a", 4))  # the writer takes it and blocks on the full pipe
        await anyio.wait_all_tasks_blocked()
        c.add_request(add("b", 4))
        c.add_request(add("c", 4))
        c.abort(["b"])  # still queued: never reaches the engine
        c.abort(["a"])  # being written: the abort follows it
        c.abort(["c"])
        got = frames(await drain(c, proc))
    assert [type(m).__name__ for m in got] == ["AddRequest", "AbortRequests"]
    assert got[0].request_id == "a" and got[1].request_ids == ["a"]


async def test_aborts_queued_back_to_back_go_out_as_one_frame() -> None:
    async with client(capacity=10) as (c, proc):
        for i in range(3):
            c.add_request(add(f"x{i}", 4))
        received = await drain(c, proc)  # all three adds are out
        c.add_request(add("y", 4))  # keeps the writer busy while the aborts queue behind it
        await anyio.wait_all_tasks_blocked()
        c.abort(["x0"])
        c.abort(["x1", "x2"])
        received += await drain(c, proc)
    got = frames(received)
    aborts = [m for m in got if isinstance(m, AbortRequests)]
    assert [a.request_ids for a in aborts] == [["x0", "x1", "x2"]]


async def test_engine_silent_past_heartbeat_is_dead_and_a_blocked_writer_ends() -> None:
    async with client(capacity=10, heartbeat_timeout=0.2) as (c, proc):
        c.add_request(add("a"))  # the writer blocks: the 'engine' reads nothing
        await anyio.wait_all_tasks_blocked()
        from engine.client.process_client import EngineDeadError

        with pytest.raises(EngineDeadError, match="no frame"):
            await c.receive()
        await anyio.wait_all_tasks_blocked()
        assert c._writer_scope.cancel_called
        with pytest.raises(EngineDeadError):
            c.add_request(add("b"))


async def test_long_step_with_heartbeats_is_alive_and_a_hung_step_is_not() -> None:
    """Liveness is the heartbeat (sent by a thread, also mid-step), not the step's length; a step that
    outruns the step timeout is a hung engine."""
    from engine.client.process_client import EngineDeadError

    proc = FakeProcess(1 << 20)
    c = EngineClient(
        StapledByteStream(proc.stdin, proc.stdout),
        OwnedEngine(proc),  # type: ignore[arg-type]
        READY,
        FrameBuffer(FromEngine),
        heartbeat_timeout=5.0,
        step_timeout=60.0,
    )
    enc = FrameEncoder()
    now = time.time()
    async with anyio.create_task_group() as tg:
        tg.start_soon(proc.stdout.send.send, enc.encode(Heartbeat(now, STATS, step_started=now - 30)))
        assert isinstance(await c.receive(), Heartbeat)  # 30 s into one step: fine
        tg.start_soon(proc.stdout.send.send, enc.encode(Heartbeat(now, STATS, step_started=now - 61)))
        with pytest.raises(EngineDeadError, match="hung"):
            await c.receive()


async def test_stop_strings_queue_200_aborts_while_both_pipes_are_full() -> None:
    """No cycle of waits: the engine blocks writing its output and reads nothing, the client's stdin is
    full, yet the output handler finishes every request that a stop string ended and queues its abort."""
    from demo.tokenizers import load_tokenizer
    from server.request.async_llm import AsyncLLM, detokenizer_factory
    from server.request.collector import OutputKind
    from server.request.input_processor import GenerationSpec

    tok = load_tokenizer("qwen2")
    stop_ids = tok.encode(" STOP here").ids
    async with client(capacity=16) as (c, proc):
        llm = AsyncLLM(c, detokenizer_factory(tok))
        async with anyio.create_task_group() as tg:
            await tg.start(llm.run)
            finished: list[str] = []

            async def one(i: int) -> None:
                spec = GenerationSpec(
                    external_id=f"s{i}",
                    request_id=f"s{i}",
                    prompt_token_ids=[1, 2, 3],
                    params=SamplingParams(max_tokens=100),
                    stop=("STOP",),
                    output_kind=OutputKind.DELTA,
                )
                async with llm.generate([spec]) as outputs:
                    async for batch in outputs:
                        for out in batch:
                            if out.finish_reason is not None:
                                finished.append(out.finish_reason)

            async with anyio.create_task_group() as clients:
                for i in range(200):
                    clients.start_soon(one, i)
                await anyio.wait_all_tasks_blocked()
                assert len(proc.stdin.buffer) == 16  # stdin full: the writer waits on the pipe with the adds
                enc = FrameEncoder()
                step = StepOutputs([RequestOutput(f"s{i}", stop_ids) for i in range(200)], time.time(), STATS)
                await proc.stdout.send.send(enc.encode(step))  # the reader takes it; the handler runs
                with anyio.fail_after(10):
                    while len(finished) < 200:
                        await anyio.wait_all_tasks_blocked()
            assert finished == ["stop"] * 200
            assert len(proc.stdin.buffer) == 16  # nothing drained the pipe meanwhile: no one waited on it
            tg.cancel_scope.cancel()
