import os
import subprocess
import sys
import threading
import time

import msgspec
import pytest

from engine.messages import (
    AbortRequests,
    AddRequest,
    EngineStats,
    FromEngine,
    Heartbeat,
    RequestOutput,
    SamplingParams,
    StepOutputs,
    ToEngine,
)
from engine.transport.ipc import MAX_FRAME, FrameBuffer, FrameEncoder, FrameError, FrameReader, FrameWriter

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
            got.extend(buf.feed(data[i : i + step]))
        assert got == messages()


def test_step_frame_round_trip() -> None:
    step = StepOutputs([RequestOutput("a", [5], finish_reason="stop", stop_token_id=5)], 3.5, STATS)
    buf: FrameBuffer[FromEngine] = FrameBuffer(FromEngine)
    assert buf.feed(FrameEncoder().encode(step) + FrameEncoder().encode(Heartbeat(1.0, STATS))) == [
        step,
        Heartbeat(1.0, STATS),
    ]


def test_corrupt_stream_is_a_frame_error() -> None:
    buf: FrameBuffer[ToEngine] = FrameBuffer(ToEngine)
    with pytest.raises(FrameError):
        buf.feed(b"\xff\xff\xff\xff")
    buf2: FrameBuffer[ToEngine] = FrameBuffer(ToEngine)
    with pytest.raises(FrameError):
        buf2.feed((3).to_bytes(4, "big") + b"abc")
    with pytest.raises(FrameError):  # a valid msgpack value of the wrong shape
        FrameBuffer(ToEngine).feed(FrameEncoder().encode({"type": "nope"}))


def test_frame_size_limit_is_per_buffer() -> None:
    frame = FrameEncoder().encode("x" * 100)
    assert FrameBuffer(str, max_frame=len(frame) - 4).feed(frame) == ["x" * 100]
    with pytest.raises(FrameError, match="exceeds"):  # refused from the header alone, before the body arrives
        FrameBuffer(str, max_frame=len(frame) - 5).feed(frame[:4])
    with pytest.raises(FrameError, match="exceeds"):
        FrameBuffer(str).feed((MAX_FRAME + 1).to_bytes(4, "big"))


def test_missing_says_how_much_of_the_frame_is_still_to_come() -> None:
    frame = FrameEncoder().encode(list(range(50)))
    buf: FrameBuffer[list[int]] = FrameBuffer(list[int])
    assert buf.missing == 4
    assert buf.feed(frame[:2]) == [] and buf.missing == 2
    assert buf.feed(frame[2:10]) == [] and buf.missing == len(frame) - 10
    assert buf.feed(frame[10:] + frame[:3]) == [list(range(50))] and buf.missing == 1


def test_reader_poll_none_waits_for_a_whole_frame() -> None:
    r, w = os.pipe()
    reader: FrameReader[str] = FrameReader(r, str)
    frame = FrameEncoder().encode("late")
    os.write(w, frame[:3])
    timer = threading.Timer(0.2, os.write, (w, frame[3:]))
    timer.start()
    got: list[str] = []
    while not got:  # a partial frame may wake poll() early: callers loop
        got = reader.poll(None)
    assert got == ["late"]
    timer.join()
    os.close(w)
    os.close(r)


_SLEEPER = (
    "from engine.transport.ipc import die_with_parent; die_with_parent(); print('up', flush=True); "
    "import time; time.sleep(60)"
)


def _exits_within(proc: subprocess.Popen[str], seconds: float) -> bool:
    try:
        proc.wait(seconds)
        return True
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return False


def test_die_with_parent_exits_when_the_parent_end_of_stdin_closes() -> None:
    # the main thread is stuck (a step or a render that never returns): only the watchdog can end it
    proc = subprocess.Popen([sys.executable, "-c", _SLEEPER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    assert proc.stdout.readline() == "up\n"
    time.sleep(0.2)
    assert proc.poll() is None  # an open pipe keeps it alive
    start = time.monotonic()
    proc.stdin.close()  # what the kernel does when the parent dies, even by SIGKILL
    assert _exits_within(proc, 5.0)
    assert time.monotonic() - start < 2.0
    proc.stdout.close()


def test_die_with_parent_exits_when_the_parent_died_before_it_looked() -> None:
    r, w = os.pipe()
    os.close(w)  # the parent is gone before the child even started watching
    proc = subprocess.Popen([sys.executable, "-c", _SLEEPER], stdin=r, stdout=subprocess.DEVNULL, text=True)
    os.close(r)
    assert _exits_within(proc, 10.0)


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
