"""The engine subprocess's loop: read frames, step the core while it has work; a thread beats the heart.

The heartbeat comes from its own thread so that liveness does not depend on step length (a first
Triton compile, a long CPU prefill): a stopped process (SIGSTOP) or one wedged holding the GIL sends
nothing, and a step stuck for longer than the server's step timeout is reported by `step_started`.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from typing import Protocol

from engine.config import EngineConfig
from engine.ipc import FrameReader, FrameWriter
from engine.messages import AbortRequests, AddRequest, EngineStats, Heartbeat, RequestOutput, StepOutputs, ToEngine

log = logging.getLogger("engine")


class _Pulse:
    """What the heartbeat thread reports: the latest stats and when the running step began."""

    def __init__(self, writer: FrameWriter, stats: EngineStats, interval: float) -> None:
        self.writer = writer
        self.stats = stats
        self.interval = interval
        self.step_started = 0.0
        self.last_sent = time.monotonic()  # any frame counts as a beat
        self.stop = threading.Event()

    def sent(self, stats: EngineStats) -> None:
        self.stats = stats
        self.last_sent = time.monotonic()

    def run(self) -> None:
        while not self.stop.wait(max(self.interval - (time.monotonic() - self.last_sent), 0.01)):
            if time.monotonic() - self.last_sent >= self.interval:
                try:
                    self.writer.send(Heartbeat(time.time(), self.stats, self.step_started))
                except OSError:
                    return  # the server is gone; the main loop sees EOF
                self.last_sent = time.monotonic()


class Core(Protocol):
    """What the loop needs of EngineCore (a stand-in in tests)."""

    @property
    def has_work(self) -> bool: ...
    def add_request(self, req: AddRequest) -> None: ...
    def abort(self, request_ids: list[str]) -> None: ...
    def step(self) -> list[RequestOutput]: ...
    def stats(self) -> EngineStats: ...


def serve(config: EngineConfig, reader: FrameReader[ToEngine], writer: FrameWriter) -> None:
    """The subprocess: build the core, say Ready, run the loop."""
    from engine.core import EngineCore  # torch: `run` alone stays light (bench/fake_engine_process.py)

    core = EngineCore(config)
    if core.pooler is None and config.structured_outputs_warmup:
        core.structured.warm_up()  # before Ready: nothing runs yet and no heartbeat is due
    gc.collect()
    gc.freeze()  # the model and startup objects live for the process: full collections skip them
    writer.send(core.ready_message())
    log.info("engine ready: %d KV blocks of %d tokens", core.runner.num_blocks, core.runner.block_size)
    try:
        run(core, config.heartbeat_interval, reader, writer)
    finally:
        close_runner(core)


def close_runner(core: object) -> None:
    """Tensor parallel: tell the other ranks to stop now, within the server's grace period, not at exit."""
    close = getattr(getattr(core, "runner", None), "close", None)
    if close is not None:
        close()


def run(core: Core, heartbeat_interval: float, reader: FrameReader[ToEngine], writer: FrameWriter) -> None:
    """Step while there is work, drain frames between steps; returns when the parent closes the pipe."""
    pulse = _Pulse(writer, core.stats(), heartbeat_interval)
    threading.Thread(target=pulse.run, name="heartbeat", daemon=True).start()
    try:
        while True:
            # busy: just drain what arrived; idle: wait for work (the thread beats meanwhile)
            msgs = reader.poll(0 if core.has_work else heartbeat_interval)
            aborts: list[str] = []
            for msg in msgs:
                if isinstance(msg, AddRequest):
                    core.add_request(msg)
                elif isinstance(msg, AbortRequests):
                    aborts.extend(msg.request_ids)
            if aborts:
                core.abort(aborts)  # before scheduling, so their blocks are free for this very step
            if reader.eof:
                return  # the parent closed our stdin (shutdown) or is gone
            if core.has_work:
                pulse.step_started = time.time()
                outputs = core.step()
                pulse.step_started = 0.0
                stats = core.stats()
                writer.send(StepOutputs(outputs, time.time(), stats))
                pulse.sent(stats)
    finally:
        pulse.stop.set()
