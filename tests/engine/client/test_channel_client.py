"""engine/client/channel_client.py: an API process's EngineClient over its channel to a shared engine.

The engine's side is the test's end of a socketpair; the "engine process" is this test process, which the
client must never wait for nor kill (SharedEngine): leaving only closes the channel.
"""

from __future__ import annotations

import os
import socket

import anyio
import pytest

from engine.client.channel_client import open_engine_channel
from engine.client.process_client import EngineLoadError
from engine.messages import AddRequest, Ready, SamplingParams, ToEngine
from engine.transport.ipc import FrameBuffer, FrameEncoder

pytestmark = pytest.mark.anyio
READY = Ready(max_model_len=64, vocab_size=100, eos_token_ids=[1], num_blocks=4, block_size=16, model_dtype="float32")


@pytest.fixture(params=["trio", "asyncio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param  # type: ignore[no-any-return]


async def test_a_channel_closed_before_ready_fails_the_start() -> None:
    mine, engine = socket.socketpair()
    engine.close()
    with pytest.raises(EngineLoadError, match=f"the engine \\(pid {os.getpid()}\\) closed this API server's channel"):
        async with open_engine_channel(mine.detach(), os.getpid(), ready_timeout=10):
            pytest.fail("no Ready was sent")


async def test_frames_flow_and_leaving_closes_only_the_channel() -> None:
    mine, engine = socket.socketpair()
    engine.sendall(FrameEncoder().encode(READY))
    async with open_engine_channel(mine.detach(), os.getpid(), ready_timeout=10) as client:
        assert client.ready == READY and client.pid == os.getpid()
        client.add_request(AddRequest("r", [2, 3], SamplingParams(max_tokens=1), 0.0))
        frames: FrameBuffer[ToEngine] = FrameBuffer(ToEngine)
        got: list[ToEngine] = []
        while not got:
            got = frames.feed(await anyio.to_thread.run_sync(engine.recv, 1 << 16))
        assert [m.request_id for m in got if isinstance(m, AddRequest)] == ["r"]
    engine.settimeout(10)
    assert engine.recv(1) == b""  # EOF: the engine aborts this channel's requests; nothing else was done to it
    engine.close()
