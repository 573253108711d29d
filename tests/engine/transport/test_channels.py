"""engine/transport/channels.py: one engine loop serving several API processes' sockets."""

from __future__ import annotations

import socket
import threading
import time

from engine.core.loop import run
from engine.messages import (
    AbortRequests,
    AddRequest,
    EngineStats,
    FromEngine,
    Heartbeat,
    RequestOutput,
    SamplingParams,
    StepOutputs,
)
from engine.transport.channels import ChannelSet
from engine.transport.ipc import FrameBuffer, FrameEncoder


class CountingCore:
    """Each running request gets one token a step and finishes after `length` tokens."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.running: dict[str, int] = {}
        self.aborted: list[str] = []
        self.lock = threading.Lock()

    @property
    def has_work(self) -> bool:
        return bool(self.running)

    def add_request(self, req: AddRequest) -> None:
        self.running[req.request_id] = 0

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            if self.running.pop(rid, None) is not None:
                self.aborted.append(rid)

    def step(self) -> list[RequestOutput]:
        time.sleep(0.002)
        outs = []
        for rid in list(self.running):
            self.running[rid] += 1
            done = self.running[rid] >= self.length
            outs.append(RequestOutput(rid, [self.running[rid]], finish_reason="length" if done else None))
            if done:
                del self.running[rid]
        return outs

    def stats(self) -> EngineStats:
        return EngineStats(len(self.running), 0, 0, 10, 0, 0, 0)


def _add(rid: str) -> AddRequest:
    return AddRequest(rid, [1, 2], SamplingParams(max_tokens=3), 0.0)


def _read_until_finished(sock: socket.socket, ids: set[str]) -> list[StepOutputs]:
    frames: FrameBuffer[FromEngine] = FrameBuffer(FromEngine)
    steps: list[StepOutputs] = []
    left = set(ids)
    sock.settimeout(10)
    while left:
        for msg in frames.feed(sock.recv(65536)):
            if isinstance(msg, StepOutputs):
                steps.append(msg)
                left -= {o.request_id for o in msg.outputs if o.finish_reason is not None}
            else:
                assert isinstance(msg, Heartbeat)
    return steps


def test_each_channel_gets_one_frame_per_step_with_only_its_own_requests() -> None:
    pairs = [socket.socketpair() for _ in range(2)]
    channels = ChannelSet([a.detach() for a, _ in pairs])
    core = CountingCore(length=3)
    loop = threading.Thread(target=run, args=(core, 0.05, channels))
    loop.start()
    enc = FrameEncoder()
    (_, api0), (_, api1) = pairs
    api0.sendall(enc.encode(_add("a1")) + enc.encode(_add("a2")))
    api1.sendall(enc.encode(_add("b1")))
    steps0 = _read_until_finished(api0, {"a1", "a2"})
    steps1 = _read_until_finished(api1, {"b1"})
    assert {o.request_id for s in steps0 for o in s.outputs} == {"a1", "a2"}
    assert {o.request_id for s in steps1 for o in s.outputs} == {"b1"}
    for steps in (steps0, steps1):  # one frame per step: a request appears once in each
        assert all(len({o.request_id for o in s.outputs}) == len(s.outputs) for s in steps)
    assert sum(len(s.outputs) for s in steps0) == 6 and sum(len(s.outputs) for s in steps1) == 3

    # an API process that goes away has its requests aborted; the others keep being served
    api0.sendall(enc.encode(_add("a3")))
    api1.sendall(enc.encode(AbortRequests(["unknown"])))
    api0.close()  # a3 may be read before the hang-up or not: either way it ends with its channel
    api1.sendall(enc.encode(_add("b2")))
    assert {o.request_id for s in _read_until_finished(api1, {"b2"}) for o in s.outputs} == {"b2"}
    api1.close()
    loop.join(10)
    assert not loop.is_alive()  # every channel closed: the loop returns
    assert "b2" not in core.aborted
