"""An API process's role under the --api-server-count launcher: its place, its fds, and what they open.

The launcher (server/runtime/launcher.py) writes the context into each API process's environment; the API
process (server/runtime/api_process.py) reads it back and hands it to `create_app(worker=...)`, which opens
its engine channels, the shared admission counts and the shared metrics through it. A single server has
no context (worker=None) and opens its own engine.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import pickle
from contextlib import AbstractAsyncContextManager
from dataclasses import asdict, dataclass, field
from typing import Any

from engine.client.channel_client import open_engine_channel
from server import shared_state
from server.config import ServerConfig
from server.metrics.prometheus import ServerMetrics
from server.shared_state import SharedAdmission, SharedRegion

ENV = "SPINDLE_API_SERVER_PROCESS"  # the API process's part: JSON (the context's fields, the pickled config)


@dataclass(frozen=True)
class WorkerContext:
    """What an API process started by the launcher gets: its place, its fds."""

    index: int
    count: int
    listen_fd: int  # the launcher's listening socket, shared by every API process
    engine_fds: list[int]  # this process's channel to each engine core, in engine order
    engine_pids: list[int]
    shared_fd: int  # the shared memory file (server/shared_state.py)
    responses_dir: str | None = None  # the launcher's directory of the stored /v1/responses, shared by all
    # --models-dir: this process's end of its control socket to the owner of the loaded set (server/fleet/owner.py)
    models_fd: int | None = None
    models_owner_fds: list[int] = field(default_factory=list)  # process 0 only: the owner's end of each one
    launcher_fd: int | None = None  # --models-dir: the read end of a pipe only the launcher writes (its lifeline)

    @functools.cached_property
    def region(self) -> SharedRegion:
        """This process's view of the shared memory (one mapping per process)."""
        return SharedRegion(self.shared_fd, self.count, self.index)

    def admission(self, config: ServerConfig) -> SharedAdmission:
        """--max-num-queued-reqs / -tokens held for all API processes together."""
        return SharedAdmission(
            self.region, config.scheduling.max_num_queued_reqs, config.scheduling.max_num_queued_tokens
        )

    def share_metrics(self, metrics: ServerMetrics) -> None:
        """Request counters and histograms summed over the API processes."""
        shared_state.share_metrics(metrics, self.region)

    def engine_routed(self, num_engines: int) -> list[Any]:
        """Requests routed to each engine, summed over the API processes."""
        return list(shared_state.engine_routed(self.region, num_engines))

    def open_engine(self, config: ServerConfig, index: int = 0) -> AbstractAsyncContextManager[Any]:
        """This process's channel to engine core `index`."""
        return open_engine_channel(
            self.engine_fds[index],
            self.engine_pids[index],
            ready_timeout=config.engine.engine_ready_timeout,
            heartbeat_timeout=config.engine.engine_heartbeat_timeout,
            step_timeout=config.engine.engine_step_timeout,
        )

    def encode(self, config: ServerConfig) -> str:
        """The environment value that gives an API process this context and the launcher's config."""
        return json.dumps({**asdict(self), "config": base64.b64encode(pickle.dumps(config)).decode()})


def from_environment() -> tuple[WorkerContext, ServerConfig]:
    """The context and config the launcher put in this process's environment (taken out of it)."""
    part = json.loads(os.environ.pop(ENV))
    config = pickle.loads(base64.b64decode(part.pop("config")))
    assert isinstance(config, ServerConfig)
    return WorkerContext(**part), config
