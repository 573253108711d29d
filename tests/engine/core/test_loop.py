"""The engine subprocess loop with a stand-in core, over real pipes: liveness does not depend on step length."""

from __future__ import annotations

import os
import threading
import time

from engine.core.loop import Pipes, run
from engine.messages import (
    AddRequest,
    EngineStats,
    FromEngine,
    Heartbeat,
    RequestOutput,
    SamplingParams,
    StepOutputs,
    ToEngine,
)
from engine.transport.ipc import FrameBuffer, FrameEncoder, FrameReader, FrameWriter

STATS = EngineStats(1, 0, 1, 10, 0, 0, 0)


class SlowCore:
    """One request; its single step blocks until the test releases it (a long prefill, a first compile)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = threading.Event()
        self.pending: list[str] = []

    @property
    def has_work(self) -> bool:
        return bool(self.pending)

    def add_request(self, req: AddRequest) -> None:
        self.pending.append(req.request_id)

    def abort(self, request_ids: list[str]) -> None:
        self.pending = [r for r in self.pending if r not in request_ids]

    def step(self) -> list[RequestOutput]:
        self.started.set()
        assert self.release.wait(30)
        done, self.pending = self.pending, []
        return [RequestOutput(rid, [7], "length") for rid in done]

    def stats(self) -> EngineStats:
        return STATS


def read_frames(fd: int, until: float) -> list[FromEngine]:
    frames: FrameBuffer[FromEngine] = FrameBuffer(FromEngine)
    out: list[FromEngine] = []
    os.set_blocking(fd, False)
    while time.monotonic() < until:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            time.sleep(0.01)  # reading another thread's pipe: nothing to wait on but the pipe
            continue
        out.extend(frames.feed(chunk))
    return out


def test_heartbeats_flow_during_a_step_longer_than_several_intervals() -> None:
    to_engine_r, to_engine_w = os.pipe()
    from_engine_r, from_engine_w = os.pipe()
    core = SlowCore()
    pipes = Pipes(FrameReader[ToEngine](to_engine_r, ToEngine), FrameWriter(from_engine_w))
    loop = threading.Thread(target=run, args=(core, 0.05, pipes), daemon=True)
    loop.start()
    os.write(to_engine_w, FrameEncoder().encode(AddRequest("r", [1, 2], SamplingParams(max_tokens=1), 0.0)))
    assert core.started.wait(10)
    t0 = time.time()
    during = read_frames(from_engine_r, time.monotonic() + 0.5)  # ten intervals inside one step
    core.release.set()
    after = read_frames(from_engine_r, time.monotonic() + 0.3)
    os.close(to_engine_w)  # EOF: the loop returns
    loop.join(10)
    beats = [f for f in during if isinstance(f, Heartbeat)]
    assert len(beats) >= 5, during
    assert all(0 < b.step_started <= t0 for b in beats)  # each says a step is running, and since when
    steps = [f for f in after if isinstance(f, StepOutputs)]
    assert [o.request_id for s in steps for o in s.outputs] == ["r"]
    assert not loop.is_alive()
