"""The engine subprocess's loop: read frames, step the core while it has work, beat the heart when idle."""

from __future__ import annotations

import gc
import logging
import time

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.ipc import FrameReader, FrameWriter
from engine.messages import AbortRequests, AddRequest, Heartbeat, Shutdown, StepOutputs, ToEngine

log = logging.getLogger("engine")


def serve(config: EngineConfig, reader: FrameReader[ToEngine], writer: FrameWriter) -> None:
    """The subprocess loop. Returns on Shutdown or when the parent closes the pipe."""
    core = EngineCore(config)
    gc.collect()
    gc.freeze()  # the model and startup objects live for the process: full collections skip them
    writer.send(core.ready_message())
    log.info("engine ready: %d KV blocks of %d tokens", core.runner.num_blocks, core.runner.block_size)
    last_sent = time.monotonic()
    while True:
        # busy: just drain what arrived; idle: wait for work, but beat the heart meanwhile
        msgs = reader.poll(0 if core.has_work else config.heartbeat_interval)
        aborts: list[str] = []
        for msg in msgs:
            if isinstance(msg, AddRequest):
                core.add_request(msg)
            elif isinstance(msg, AbortRequests):
                aborts.extend(msg.request_ids)
            elif isinstance(msg, Shutdown):
                return
        if aborts:
            core.abort(aborts)  # before scheduling, so their blocks are free for this very step
        if reader.eof:
            return  # the parent is gone
        if core.has_work:
            outputs = core.step()
            writer.send(StepOutputs(outputs, time.time(), core.stats()))
            last_sent = time.monotonic()
        elif time.monotonic() - last_sent >= config.heartbeat_interval:
            writer.send(Heartbeat(time.time(), core.stats()))
            last_sent = time.monotonic()
