"""Start-up's stages, said while they run: AppState.stage (what /health's 503 answers) is set, and the log says the
stage is still running at least every 10 s, so a long first start (a GGUF file's config and tokenizer derived, a
big checkpoint read) is never silent."""

from __future__ import annotations

import logging
import time

import anyio

from server.app_state import AppState

log = logging.getLogger("spindle.server")
TICK_S = 10.0


def enter(state: AppState, text: str) -> None:
    """Start-up is now doing `text`: logged once here, then every TICK_S by report_stages while it lasts."""
    state.stage = text
    log.info("start-up: %s", text)


async def report_stages(state: AppState, every: float = TICK_S) -> None:
    """Until the model serves: every `every` seconds, a line saying which stage is still running, for how long."""
    current, since = state.stage, time.monotonic()
    while True:
        await anyio.sleep(every)
        if state.stage == "ready":
            return
        if state.stage != current:
            current, since = state.stage, time.monotonic()
        log.info("start-up: still %s (%.0f s)", current, time.monotonic() - since)
