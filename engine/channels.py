"""The engine's side of several API-server processes (`--api-server-count N`): one socket per API process.

Each API server process has its own channel to this engine core: a Unix socketpair whose other end only that
process holds (`server/runtime/launcher.py` makes them). The loop reads frames from every channel between steps,
remembers which channel added each request, and after a step sends each channel that has outputs ONE
`StepOutputs` frame with the outputs of its own requests (never one frame per request). `Ready` and
`LoadFailed` go to every channel; the heartbeat thread beats on every channel that has been silent for the
interval. A channel that closes (its API process stopped or died) has its requests aborted and is dropped;
the loop returns when every channel is closed. fd 0 stays the launcher's lifeline (`die_with_parent`).
"""

from __future__ import annotations

import gc
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

from engine.ipc import FrameBuffer, FrameEncoder
from engine.loop import close_runner
from engine.messages import AbortRequests, AddRequest, EngineStats, Heartbeat, RequestOutput, StepOutputs, ToEngine

log = logging.getLogger("engine")


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

    def send(self, msg: Any) -> bool:
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
    """All the API processes' channels. `send` broadcasts (Ready, LoadFailed): it stands in for a FrameWriter."""

    def __init__(self, fds: Sequence[int]) -> None:
        self.channels = [Channel(i, fd) for i, fd in enumerate(fds)]
        self._selector = selectors.DefaultSelector()
        for ch in self.channels:
            self._selector.register(ch.sock, selectors.EVENT_READ, ch)

    @property
    def open(self) -> list[Channel]:
        return [ch for ch in self.channels if not ch.closed]

    def send(self, msg: Any) -> None:
        for ch in self.channels:
            ch.send(msg)

    def poll(self, timeout: float) -> tuple[list[tuple[Channel, ToEngine]], list[Channel]]:
        """(channel, frame) pairs available now (waiting up to `timeout` for the first), and channels that closed."""
        msgs: list[tuple[Channel, ToEngine]] = []
        closed: list[Channel] = []
        if not self.open:
            return msgs, closed
        for key, _ in self._selector.select(timeout):
            ch: Channel = key.data
            msgs.extend((ch, m) for m in ch.read())
            if ch.closed:
                closed.append(ch)
        for ch in closed:
            self._selector.unregister(ch.sock)
        return msgs, closed


class _Pulse:
    def __init__(self, channels: ChannelSet, stats: EngineStats, interval: float) -> None:
        self.channels = channels
        self.stats = stats
        self.interval = interval
        self.step_started = 0.0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.interval / 4):
            now = time.monotonic()
            for ch in self.channels.open:
                if now - ch.last_sent >= self.interval:
                    ch.send(Heartbeat(time.time(), self.stats, self.step_started))


def serve_channels(config: Any, channels: ChannelSet) -> None:
    """The subprocess with several channels: build the core, say Ready on each, run the loop."""
    from engine.core import EngineCore

    core = EngineCore(config)
    gc.collect()
    gc.freeze()
    channels.send(core.ready_message())
    log.info("engine ready for %d API servers: %d KV blocks of %d tokens", len(channels.channels),
             core.runner.num_blocks, core.runner.block_size)
    try:
        run_channels(core, config.heartbeat_interval, channels)
    finally:
        close_runner(core)
    wait_for_lifeline()


def run_channels(core: Any, heartbeat_interval: float, channels: ChannelSet) -> None:
    """engine/loop.py `run` over several channels; returns when every channel has closed."""
    pulse = _Pulse(channels, core.stats(), heartbeat_interval)
    threading.Thread(target=pulse.run, name="heartbeat", daemon=True).start()
    owner: dict[str, Channel] = {}  # request id -> the channel that added it
    try:
        while channels.open:
            msgs, closed = channels.poll(0 if core.has_work else heartbeat_interval)
            aborts: list[str] = []
            for ch, msg in msgs:
                if isinstance(msg, AddRequest):
                    owner[msg.request_id] = ch
                    core.add_request(msg)
                elif isinstance(msg, AbortRequests):
                    aborts.extend(msg.request_ids)
            for ch in closed:  # its API process is gone: nobody reads these requests any more
                aborts.extend(rid for rid, c in owner.items() if c is ch)
            if aborts:
                for rid in aborts:
                    owner.pop(rid, None)
                core.abort(aborts)
            if core.has_work:
                pulse.step_started = time.time()
                outputs = core.step()
                pulse.step_started = 0.0
                stats = core.stats()
                pulse.stats = stats
                now = time.time()
                routed = _route(outputs, owner)
                for ch, outs in routed.items():
                    if not ch.send(StepOutputs(outs, now, stats)):
                        lost = [rid for rid, c in owner.items() if c is ch]
                        for rid in lost:
                            del owner[rid]
                        core.abort(lost)
                if not core.has_work:  # idle now: the other channels get the final stats at once, not a beat later
                    for ch in channels.open:
                        if ch not in routed:
                            ch.send(Heartbeat(now, stats, 0.0))
    finally:
        pulse.stop.set()


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
