"""The child side of server/render/worker_pool.py's processes (render workers, the image worker): reply codes,
priority, signals, the parent watchdog and the frame streams."""

from __future__ import annotations

import os
import signal
from collections import deque
from collections.abc import Callable
from typing import Any

from engine.transport.ipc import FrameReader, FrameWriter, die_with_parent

OK, USER_ERROR, INTERNAL_ERROR = 0, 1, 2  # reply codes: [code, result | message]

# As engine/__main__.py's NICE_BELOW_SERVER: a long tokenization (a 1M-character prompt takes seconds of a
# core) or an image must not take the core the server's event loop wants (bench/README.md, "Responsiveness under load").
NICE_BELOW_SERVER = 10


def start_child() -> tuple[Callable[[], Any], FrameWriter]:
    """Set the process up as a pool child; returns (receive: the next frame, None at EOF) and the writer."""
    try:
        os.nice(NICE_BELOW_SERVER)  # first: Linux nice is per thread, and the watchdog thread inherits it
    except OSError:  # raising nice needs no privilege; a sandbox that forbids it only costs responsiveness
        pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the parent shuts us down
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # so does a process group's SIGTERM: the server drains first
    die_with_parent()  # exit with the parent, even mid-request
    out_fd = os.dup(1)
    os.dup2(2, 1)  # stray prints go to stderr, never into the frame stream
    reader: FrameReader[Any] = FrameReader(0, Any)
    pending: deque[Any] = deque()

    def receive() -> Any:
        while not pending and not reader.eof:
            pending.extend(reader.poll(None))
        return pending.popleft() if pending else None

    return receive, FrameWriter(out_fd)
