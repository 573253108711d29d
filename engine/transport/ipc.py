"""The pipe contract between a child process and its parent: frames, and the child's lifetime.

Frames: 4-byte big-endian length, then the msgspec msgpack payload. `FrameEncoder` / `FrameBuffer` are
the codec every side shares (the engine and its client, the render workers and their pool), so a frame
split across reads is reassembled and size-checked the same way; `FrameWriter` / `FrameReader` are the
blocking-fd side used inside child processes. `die_with_parent` ends a child whose parent is gone.
Kept free of heavy imports (no torch): the render worker imports it.
"""

from __future__ import annotations

import os
import select
import selectors
import threading
import time
from typing import Any, Generic, TypeVar

import msgspec

T = TypeVar("T")
HEADER = 4
MAX_FRAME = 1 << 30  # a corrupt length must not make us allocate without bound


class FrameError(RuntimeError):
    """The byte stream is not a sequence of valid frames (corruption or a foreign writer)."""


class FrameEncoder:
    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, msg: Any) -> bytes:
        buf = bytearray(HEADER)
        self._encoder.encode_into(msg, buf, HEADER)
        buf[:HEADER] = (len(buf) - HEADER).to_bytes(HEADER, "big")
        return bytes(buf)


class FrameBuffer(Generic[T]):
    """Feed bytes in any split; get whole decoded messages out."""

    def __init__(self, msg_type: Any, max_frame: int = MAX_FRAME) -> None:
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(msg_type)
        self._max_frame = max_frame
        self._buf = bytearray()

    @property
    def missing(self) -> int:
        """Bytes still to come before the next frame is whole (a hint for how much to read)."""
        if len(self._buf) < HEADER:
            return HEADER - len(self._buf)
        return max(0, HEADER + int.from_bytes(self._buf[:HEADER], "big") - len(self._buf))

    def feed(self, data: bytes) -> list[T]:
        self._buf += data
        out: list[T] = []
        pos, buf = 0, self._buf
        while len(buf) - pos >= HEADER:
            size = int.from_bytes(buf[pos : pos + HEADER], "big")
            if size > self._max_frame:
                raise FrameError(f"frame of {size} bytes exceeds the {self._max_frame} byte limit")
            end = pos + HEADER + size
            if len(buf) < end:
                break
            try:
                out.append(self._decoder.decode(memoryview(buf)[pos + HEADER : end]))
            except msgspec.DecodeError as e:
                raise FrameError(f"undecodable frame: {e}") from e
            pos = end
        if pos:
            del buf[:pos]
        return out


class FrameWriter:
    """Blocking writes of whole frames to a file descriptor (a child's output pipe), from any thread."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._encoder = FrameEncoder()
        self._lock = threading.Lock()  # the engine's heartbeat thread writes too: frames must not interleave

    def send(self, msg: Any) -> None:
        with self._lock:
            data = memoryview(self._encoder.encode(msg))
            while data:
                data = data[os.write(self._fd, data) :]


class FrameReader(Generic[T]):
    """Reads frames from a file descriptor, waiting at most `timeout` seconds for the first byte."""

    def __init__(self, fd: int, msg_type: Any, max_frame: int = MAX_FRAME) -> None:
        self._fd = fd
        os.set_blocking(fd, False)
        self._frames: FrameBuffer[T] = FrameBuffer(msg_type, max_frame)
        self._selector = selectors.DefaultSelector()
        self._selector.register(fd, selectors.EVENT_READ)
        self.eof = False

    def poll(self, timeout: float | None) -> list[T]:
        """Every whole frame available now (waiting up to `timeout`, None: for ever, if none); sets `eof` at EOF.

        May return [] before `timeout` (a partial frame arrived): callers loop.
        """
        if self.eof or not self._selector.select(timeout):
            return []
        out: list[T] = []
        while True:
            try:
                chunk = os.read(self._fd, 1 << 20)
            except BlockingIOError:
                return out
            if not chunk:
                self.eof = True
                return out
            out.extend(self._frames.feed(chunk))


def die_with_parent(fd: int = 0, grace: float = 0.0) -> None:
    """Exit when the writers of pipe `fd` (our stdin: only the parent holds its write end) are gone, after
    `grace` seconds in which the main thread may finish on its own (it saw the same EOF).

    Covers a SIGKILLed parent even while the main thread is stuck in a step or a render. A hang-up on
    the pipe cannot be missed, unlike a getppid() poll (which never fires if the parent died before we
    first looked, and lags by its interval). Not PR_SET_PDEATHSIG: it fires when the spawning *thread*
    exits, and Trio spawns from a worker thread that exits when idle.
    """

    def watch() -> None:
        poller = select.poll()
        poller.register(fd, 0)  # no events asked: poll() still reports POLLHUP/POLLERR/POLLNVAL
        while True:
            for _fd, event in poller.poll():
                if event & (select.POLLHUP | select.POLLERR | select.POLLNVAL):
                    time.sleep(grace)
                    os._exit(0)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()
