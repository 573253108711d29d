"""Length-prefixed msgpack frames over pipes: 4-byte big-endian length, then the msgspec payload.

`FrameWriter` / `FrameReader` are the engine process's blocking-fd side; `FrameBuffer` is the
incremental parser both sides use, so a frame split across reads is reassembled the same way.
"""

from __future__ import annotations

import os
import selectors
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

    def __init__(self, msg_type: Any) -> None:
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(msg_type)
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[T]:
        self._buf += data
        out: list[T] = []
        pos, buf = 0, self._buf
        while len(buf) - pos >= HEADER:
            size = int.from_bytes(buf[pos:pos + HEADER], "big")
            if size > MAX_FRAME:
                raise FrameError(f"frame of {size} bytes exceeds the {MAX_FRAME} byte limit")
            end = pos + HEADER + size
            if len(buf) < end:
                break
            try:
                out.append(self._decoder.decode(memoryview(buf)[pos + HEADER:end]))
            except msgspec.DecodeError as e:
                raise FrameError(f"undecodable frame: {e}") from e
            pos = end
        if pos:
            del buf[:pos]
        return out


class FrameWriter:
    """Blocking writes of whole frames to a file descriptor (the engine's output pipe)."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._encoder = FrameEncoder()

    def send(self, msg: Any) -> None:
        data = memoryview(self._encoder.encode(msg))
        while data:
            data = data[os.write(self._fd, data):]


class FrameReader(Generic[T]):
    """Reads frames from a file descriptor, waiting at most `timeout` seconds for the first byte."""

    def __init__(self, fd: int, msg_type: Any) -> None:
        self._fd = fd
        os.set_blocking(fd, False)
        self._frames: FrameBuffer[T] = FrameBuffer(msg_type)
        self._selector = selectors.DefaultSelector()
        self._selector.register(fd, selectors.EVENT_READ)
        self.eof = False

    def poll(self, timeout: float) -> list[T]:
        """Every whole frame available now (waiting up to `timeout` if none); sets `eof` when the peer closed."""
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
