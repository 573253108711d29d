"""The engine's side of several API-server processes (`--api-server-count N`): one socket per API process.

Each API server process has its own channel to this engine core: a Unix socketpair whose other end only that
process holds (`server/runtime/launcher.py` makes them). The engine loop (engine/core/loop.py `run`, the same loop
as
over one server's pipes) reads frames from every channel between steps; `ChannelSet` remembers which channel
added each request, and after a step sends each channel that has outputs ONE `StepOutputs` frame with the
outputs of its own requests (never one frame per request). `Ready` and
`LoadFailed` go to every channel; the heartbeat thread beats on every channel that has been silent for the
interval. A channel that closes (its API process stopped or died) has its requests aborted and is dropped;
the loop returns when every channel is closed. fd 0 stays the launcher's lifeline (`die_with_parent`).
"""

from __future__ import annotations

import os
import selectors
import socket
import threading
import time
from collections.abc import Sequence

from engine.messages import (
    AbortRequests,
    AddRequest,
    EngineStats,
    FromEngine,
    Heartbeat,
    RequestOutput,
    StepOutputs,
    ToEngine,
)
from engine.transport.ipc import FrameBuffer, FrameEncoder


class Channel:
    """One API process's socket: blocking whole-frame writes (from the loop or the heartbeat thread),
    non-blocking reads."""

    def __init__(self, index: int, fd: int) -> None:
        self.index = index
        self.sock = socket.socket(fileno=fd)
        self.sock.setblocking(True)  # writes block (the API process's reader is never stuck on us)
        self.frames: FrameBuffer[ToEngine] = FrameBuffer(ToEngine)
        self._encoder = FrameEncoder()
        self._lock = threading.Lock()
        self.closed = False
        self.last_sent = time.monotonic()

    def send(self, msg: FromEngine) -> bool:
        """Write one frame; False (and the channel closed) if its API process is gone."""
        if self.closed:
            return False
        data = self._encoder.encode(msg)
        with self._lock:
            try:
                self.sock.sendall(data)
            except OSError:
                self.closed = True
                return False
            self.last_sent = time.monotonic()
        return True

    def read(self) -> list[ToEngine]:
        """Every whole frame available now; sets `closed` at EOF."""
        out: list[ToEngine] = []
        while not self.closed:
            try:
                chunk = self.sock.recv(1 << 20, socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
            except OSError:
                chunk = b""
            if not chunk:
                self.closed = True
                break
            out.extend(self.frames.feed(chunk))
        return out


class ChannelSet:
    """All the API processes' channels: the engine loop's `Links` (engine/core/loop.py) when there are several.

    Remembers which channel added each request, so a step's outputs go only to their channel and a channel's
    requests are aborted when it closes."""

    def __init__(self, fds: Sequence[int]) -> None:
        self.channels = [Channel(i, fd) for i, fd in enumerate(fds)]
        self._selector = selectors.DefaultSelector()
        for ch in self.channels:
            self._selector.register(ch.sock, selectors.EVENT_READ, ch)
        self._owner: dict[str, Channel] = {}  # request id -> the channel that added it
        self._routed: dict[Channel, list[RequestOutput]] = {}  # the last step's outputs, by channel

    @property
    def open(self) -> list[Channel]:
        return [ch for ch in self.channels if not ch.closed]

    def broadcast(self, msg: FromEngine) -> None:
        for ch in self.channels:
            ch.send(msg)

    def receive(self, timeout: float) -> tuple[list[ToEngine], list[str]]:
        """Frames available now (waiting up to `timeout` for the first), and the requests of channels that closed."""
        msgs: list[ToEngine] = []
        closed: list[Channel] = []
        if not self.open:
            return msgs, []
        for key, _ in self._selector.select(timeout):
            ch: Channel = key.data
            for msg in ch.read():
                if isinstance(msg, AddRequest):
                    self._owner[msg.request_id] = ch
                elif isinstance(msg, AbortRequests):
                    for rid in msg.request_ids:
                        self._owner.pop(rid, None)
                msgs.append(msg)
            if ch.closed:
                closed.append(ch)
        for ch in closed:
            self._selector.unregister(ch.sock)
        # its API process is gone: nobody reads these requests any more
        return msgs, [rid for ch in closed for rid in self._drop(ch)]

    def deliver(self, outputs: list[RequestOutput], stats: EngineStats, now: float) -> list[str]:
        """ONE StepOutputs frame to each channel with outputs (its own requests only); the requests of channels
        found gone."""
        self._routed = _route(outputs, self._owner)
        lost: list[str] = []
        for ch, outs in self._routed.items():
            if not ch.send(StepOutputs(outs, now, stats)):
                lost.extend(self._drop(ch))
        return lost

    def idle(self, stats: EngineStats, now: float) -> None:
        for ch in self.open:
            if ch not in self._routed:
                ch.send(Heartbeat(now, stats, 0.0))

    def _drop(self, ch: Channel) -> list[str]:
        """Forget the requests `ch` added: the ids."""
        ids = [rid for rid, c in self._owner.items() if c is ch]
        for rid in ids:
            del self._owner[rid]
        return ids


def wait_for_lifeline(fd: int = 0) -> None:
    """Every channel has closed: return only at EOF on the launcher's lifeline (it closes it once it has reaped
    every API process). An engine that exited as soon as its last channel closed could be reaped before that
    channel's API process, and the launcher counts an engine that goes first as engine death (exit 1)."""
    try:
        while os.read(fd, 1 << 16):
            pass
    except OSError:
        pass


def _route(outputs: list[RequestOutput], owner: dict[str, Channel]) -> dict[Channel, list[RequestOutput]]:
    """Outputs grouped by the channel that owns each request; finished requests leave `owner`."""
    by_channel: dict[Channel, list[RequestOutput]] = {}
    for out in outputs:
        ch = owner.get(out.request_id)
        if ch is None:  # aborted meanwhile
            continue
        if out.finish_reason is not None:
            del owner[out.request_id]
        outs = by_channel.get(ch)
        if outs is None:
            by_channel[ch] = [out]
        else:
            outs.append(out)
    return by_channel
