"""Logging set-up, once per process: one level (the engine subprocess reads it too) and one line format."""

from __future__ import annotations

import logging
import os


def setup_logging(level: str, *, tag: str = "") -> None:
    """The root handler at `level`; `tag` (an API process's "api-server 1") follows each line's logger name."""
    os.environ["SPINDLE_LOG_LEVEL"] = level  # the engine subprocesses log at the same level
    name = f"%(name)s[{tag}]" if tag else "%(name)s"
    logging.basicConfig(level=level.upper(), format=f"%(asctime)s %(levelname)s {name}: %(message)s")
    # The format shows none of these: skip computing them for every record (an access-log line per request).
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    logging._srcfile = None  # no caller lookup (the logging HOWTO's "Optimization" section)
