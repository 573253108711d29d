"""The real engine subprocess behind the anyio client, on Trio and asyncio."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import anyio
import pytest

from engine.client.process_client import EngineDeadError, EngineLoadError, open_engine
from engine.config import EngineConfig
from engine.messages import AddRequest, Heartbeat, SamplingParams, StepOutputs
from tests.helpers.processes import alive, wait_gone

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["trio", "asyncio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param  # type: ignore[no-any-return]


def config(ckpt: Path, **kw: object) -> EngineConfig:
    return EngineConfig(model=str(ckpt), num_blocks=128, heartbeat_interval=0.1, **kw)  # type: ignore[arg-type]


async def test_generate_then_heartbeats(qwen2_ckpt: Path) -> None:
    async with open_engine(config(qwen2_ckpt)) as engine:
        assert engine.ready.max_model_len > 0 and engine.ready.num_blocks == 128
        engine.add_request(
            AddRequest("x", [1, 2, 3, 4], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), time.time())
        )
        got: list[int] = []
        finish = None
        with anyio.fail_after(60):
            while finish is None:
                msg = await engine.receive()
                if isinstance(msg, StepOutputs):
                    for o in msg.outputs:
                        got += o.new_token_ids
                        finish = o.finish_reason
        assert len(got) == 5 and finish == "length"
        with anyio.fail_after(5):  # idle engine keeps beating
            assert isinstance(await engine.receive(), Heartbeat)
        assert engine.stats.num_used_blocks == 0


async def test_sigkill_of_engine_raises_dead_within_1s(qwen2_ckpt: Path) -> None:
    async with open_engine(config(qwen2_ckpt)) as engine:
        engine.add_request(
            AddRequest("long", [1, 2, 3], SamplingParams(max_tokens=100_000 // 100, ignore_eos=True), time.time())
        )
        await engine.receive()
        os.kill(engine.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError):
            with anyio.fail_after(1.0):
                while True:
                    await engine.receive()
        assert time.monotonic() - t0 < 1.0
        with pytest.raises(EngineDeadError):
            engine.add_request(AddRequest("after", [1], SamplingParams(max_tokens=1), 0.0))


async def test_load_error_says_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(EngineLoadError, match="config.json"):
        async with open_engine(EngineConfig(model=str(tmp_path))):
            pass


def test_engine_dies_with_its_parent(qwen2_ckpt: Path, tmp_path: Path) -> None:
    """SIGKILL of the server process leaves no engine behind."""
    script = textwrap.dedent(f"""
        import anyio, sys
        from engine.client.process_client import open_engine
        from engine.config import EngineConfig
        async def main():
            async with open_engine(EngineConfig(model={str(qwen2_ckpt)!r}, num_blocks=16)) as e:
                print(e.pid, flush=True)
                await anyio.sleep(60)
        anyio.run(main)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    engine_pid = int(parent.stdout.readline())
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    try:
        wait_gone(engine_pid, 5)
    finally:
        if alive(engine_pid):
            os.kill(engine_pid, signal.SIGKILL)
