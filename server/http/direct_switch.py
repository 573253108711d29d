"""The direct write paths' on/off switch, one per process: on at start, off for good after the first failure.

Both fast paths read it (server/http/direct_body.py, the chunk writer; server/http/trio_send.py, the Trio
send) and either may turn it off; it lives here so that neither has to import the other for it.
"""

from __future__ import annotations

import logging

log = logging.getLogger("spindle.server")

_active = True  # False once a fast path failed at request time: ASGI only for the rest of the process


def is_active() -> bool:
    return _active


def decline(error: BaseException) -> None:
    """A fast path met something it was not written for: turn them off for the process, warn once."""
    global _active
    if _active:
        _active = False
        log.warning(
            "direct body writes turned off after %s: %s; streaming through ASGI from now on",
            type(error).__name__,
            error,
        )
