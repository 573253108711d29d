import os

import msgspec
import pytest

from engine.ipc import FrameBuffer, FrameEncoder, FrameError, FrameReader, FrameWriter
from engine.messages import (AbortRequests, AddRequest, EngineStats, FromEngine, Heartbeat,
                             RequestOutput, SamplingParams, StepOutputs, ToEngine)

STATS = EngineStats(1, 2, 3, 4, 5, 6, 7)


def messages() -> list[object]:
    return [
        AddRequest("r-1", [1, 2, 3], SamplingParams(max_tokens=5, seed=7, logit_bias={3: -1.5}), 1.0),
        AbortRequests(["r-1", "r-2"]),
        AddRequest("r-2", list(range(5000)), SamplingParams(max_tokens=1), 2.0, priority=-3),
    ]


def test_frames_survive_every_split() -> None:
    enc = FrameEncoder()
    data = b"".join(enc.encode(m) for m in messages())
    for step in (1, 3, 7, 64, len(data)):
        buf: FrameBuffer[ToEngine] = FrameBuffer(ToEngine)
        got: list[object] = []
        for i in range(0, len(data), step):
            got.extend(buf.feed(data[i:i + step]))
        assert got == messages()


def test_step_frame_round_trip() -> None:
    step = StepOutputs([RequestOutput("a", [5], finish_reason="stop", stop_token_id=5)], 3.5, STATS)
    buf: FrameBuffer[FromEngine] = FrameBuffer(FromEngine)
    assert buf.feed(FrameEncoder().encode(step) + FrameEncoder().encode(Heartbeat(1.0, STATS))) == [
        step, Heartbeat(1.0, STATS)]


def test_corrupt_stream_is_a_frame_error() -> None:
    buf: FrameBuffer[ToEngine] = FrameBuffer(ToEngine)
    with pytest.raises(FrameError):
        buf.feed(b"\xff\xff\xff\xff")
    buf2: FrameBuffer[ToEngine] = FrameBuffer(ToEngine)
    with pytest.raises(FrameError):
        buf2.feed((3).to_bytes(4, "big") + b"abc")
    with pytest.raises(FrameError):  # a valid msgpack value of the wrong shape
        FrameBuffer(ToEngine).feed(FrameEncoder().encode({"type": "nope"}))


def test_reader_writer_over_a_pipe_and_eof() -> None:
    r, w = os.pipe()
    reader: FrameReader[ToEngine] = FrameReader(r, ToEngine)
    writer = FrameWriter(w)
    assert reader.poll(0) == []
    for m in messages():
        writer.send(m)
    got: list[object] = []
    while len(got) < 3:
        got.extend(reader.poll(1.0))
    assert got == messages()
    os.close(w)
    assert reader.poll(1.0) == [] and reader.eof
    os.close(r)


def test_messages_are_msgspec_structs() -> None:
    # the wire contract is typed: wrong types are refused at decode time
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode({"type": "add", "request_id": 1}), type=ToEngine)
