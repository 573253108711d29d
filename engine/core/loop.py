"""The engine subprocess's loop: read frames, step the core while it has work; a thread beats the heart.

The loop reads and writes through `Links`: the stdin/stdout pipes of one API server (`Pipes`, here), or one
socket per API server process (engine/transport/channels.py `ChannelSet`). Either way it is this one loop and this
one heartbeat thread.

The heartbeat comes from its own thread so that liveness does not depend on step length (a first
Triton compile, a long CPU prefill): a stopped process (SIGSTOP) or one wedged holding the GIL sends
nothing, and a step stuck for longer than the server's step timeout is reported by `step_started`.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Sequence
from typing import Protocol

from engine.config import EngineConfig
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
from engine.transport.ipc import FrameReader, FrameWriter

log = logging.getLogger("engine")


class Link(Protocol):
    """One reader of the engine's frames (an API server); the loop and the heartbeat thread both write to it."""

    @property
    def last_sent(self) -> float:
        """time.monotonic() of the last frame written (any frame counts as a beat)."""
        ...

    def send(self, msg: FromEngine) -> bool:
        """Write one whole frame; False when the reader is gone."""
        ...


class Links(Protocol):
    """Where the loop's frames come from and go."""

    @property
    def open(self) -> Sequence[Link]:
        """The readers still there; the loop returns when none is left."""
        ...

    def broadcast(self, msg: FromEngine) -> None:
        """To every reader (Ready, LoadFailed)."""
        ...

    def receive(self, timeout: float) -> tuple[list[ToEngine], list[str]]:
        """Frames available now (waiting up to `timeout` for the first), and the ids of requests whose sender left."""
        ...

    def deliver(self, outputs: list[RequestOutput], stats: EngineStats, now: float) -> list[str]:
        """A step's outputs to their readers; the ids of requests whose reader is gone (to abort)."""
        ...

    def idle(self, stats: EngineStats, now: float) -> None:
        """The core ran out of work: readers that got no frame this step get the final stats now, not a beat later."""
        ...


class Pipes:
    """One API server's pipes: frames in on stdin, out on the original stdout (`python -m engine` alone)."""

    def __init__(self, reader: FrameReader[ToEngine], writer: FrameWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.last_sent = time.monotonic()
        self.broken = False  # a write failed: the server is gone

    @property
    def open(self) -> list[Pipes]:
        return [] if self.reader.eof or self.broken else [self]

    def broadcast(self, msg: FromEngine) -> None:
        self.send(msg)

    def send(self, msg: FromEngine) -> bool:
        try:
            self.writer.send(msg)
        except OSError:
            self.broken = True
            return False
        self.last_sent = time.monotonic()
        return True

    def receive(self, timeout: float) -> tuple[list[ToEngine], list[str]]:
        return self.reader.poll(timeout), []  # the server's own requests end with it: nothing to abort

    def deliver(self, outputs: list[RequestOutput], stats: EngineStats, now: float) -> list[str]:
        self.send(StepOutputs(outputs, now, stats))  # every step, empty or not: its stats are news
        return []

    def idle(self, stats: EngineStats, now: float) -> None:
        pass  # the last step's frame carried the final stats


class _Pulse:
    """What the heartbeat thread reports: the latest stats and when the running step began."""

    def __init__(self, links: Links, stats: EngineStats, interval: float) -> None:
        self.links = links
        self.stats = stats
        self.interval = interval
        self.step_started = 0.0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self._until_due()):
            now = time.monotonic()
            for link in self.links.open:
                if now - link.last_sent >= self.interval:
                    link.send(Heartbeat(time.time(), self.stats, self.step_started))

    def _until_due(self) -> float:
        """Seconds until the longest-silent reader is due a beat."""
        sent = [link.last_sent for link in self.links.open]
        if not sent:
            return self.interval
        return max(min(sent) + self.interval - time.monotonic(), 0.01)


class Core(Protocol):
    """What the loop needs of EngineCore (a stand-in in tests)."""

    @property
    def has_work(self) -> bool: ...
    def add_request(self, req: AddRequest) -> None: ...
    def abort(self, request_ids: list[str]) -> None: ...
    def step(self) -> list[RequestOutput]: ...
    def stats(self) -> EngineStats: ...


def serve(config: EngineConfig, links: Links) -> None:
    """The subprocess: build the core, say Ready, run the loop."""
    from engine.core.engine_core import (
        EngineCore,
    )  # why late: torch; `run` alone stays light (bench/fake_engine_process.py)

    core = EngineCore(config)
    if core.pooler is None and config.structured_outputs_warmup:
        core.structured.warm_up()  # before Ready: nothing runs yet and no heartbeat is due
    gc.collect()
    gc.freeze()  # the model and startup objects live for the process: full collections skip them
    links.broadcast(core.ready_message())
    log.info(
        "engine ready for %d API server(s): %d KV blocks of %d tokens",
        len(links.open),
        core.runner.num_blocks,
        core.runner.block_size,
    )
    try:
        run(core, config.heartbeat_interval, links)
    finally:
        close_runner(core)
        if core.block_manager.disk is not None:  # the queued KV blocks reach the disk before the process ends
            core.block_manager.disk.store.close()


def close_runner(core: object) -> None:
    """Tensor parallel: tell the other ranks to stop now, within the server's grace period, not at exit."""
    close = getattr(getattr(core, "runner", None), "close", None)
    if close is not None:
        close()


def run(core: Core, heartbeat_interval: float, links: Links) -> None:
    """Step while there is work, drain frames between steps; returns when every reader has left."""
    pulse = _Pulse(links, core.stats(), heartbeat_interval)
    threading.Thread(target=pulse.run, name="heartbeat", daemon=True).start()
    try:
        while links.open:
            # busy: just drain what arrived; idle: wait for work (the thread beats meanwhile)
            msgs, aborts = links.receive(0 if core.has_work else heartbeat_interval)
            for msg in msgs:
                if isinstance(msg, AddRequest):
                    core.add_request(msg)
                elif isinstance(msg, AbortRequests):
                    aborts.extend(msg.request_ids)
            if aborts:
                core.abort(aborts)  # before scheduling, so their blocks are free for this very step
            if not links.open:
                return  # the server closed our stdin (shutdown), or every API process is gone
            if core.has_work:
                _step(core, pulse, links)
    finally:
        pulse.stop.set()


def _step(core: Core, pulse: _Pulse, links: Links) -> None:
    pulse.step_started = time.time()
    outputs = core.step()
    pulse.step_started = 0.0
    stats = pulse.stats = core.stats()
    now = time.time()
    lost = links.deliver(outputs, stats, now)
    if lost:
        core.abort(lost)
    if not core.has_work:
        links.idle(stats, now)
