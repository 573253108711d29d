"""Model-load progress: a redrawn bar on a terminal, a few plain log lines otherwise (files, journald)."""

from __future__ import annotations

import logging
import sys
import time
from typing import TextIO

log = logging.getLogger("engine")
LOG_EVERY_S = 10.0  # the longest a load goes without a line in a log file


class LoadProgress:
    """Counts loaded tensors out of `total`. Terminal: one `\\r` bar; else a line per `step_pct` percent."""

    def __init__(
        self,
        total: int,
        label: str = "loading weights",
        *,
        stream: TextIO | None = None,
        step_pct: int = 25,
        min_redraw_s: float = 0.1,
        quiet: bool = False,
    ) -> None:
        """quiet: count, but draw and log nothing."""
        self.total = max(total, 1)
        self.quiet = quiet
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.tty = not quiet and bool(getattr(self.stream, "isatty", lambda: False)())
        self.step_pct = step_pct
        self.min_redraw_s = min_redraw_s
        self.done = 0
        self.start = time.monotonic()
        self._last_draw = 0.0
        self._last_pct = -1
        self._last_log = self.start
        self._closed = False
        if not self.tty and not quiet:
            log.info("%s: %d tensors", label, total)

    def advance(self, n: int = 1) -> None:
        self.done = min(self.done + n, self.total)
        if self.tty:
            now = time.monotonic()
            if now - self._last_draw >= self.min_redraw_s or self.done == self.total:
                self._last_draw = now
                self._draw()
            return
        if self.quiet:
            return
        pct = self.done * 100 // self.total
        mark = pct - pct % self.step_pct
        now = time.monotonic()
        # a line per step_pct, and one at least every LOG_EVERY_S however slowly the tensors come (a big model)
        if (mark > self._last_pct or now - self._last_log >= LOG_EVERY_S) and pct < 100:  # 100 %: the closing line
            self._last_pct, self._last_log = max(mark, self._last_pct), now
            log.info("%s: %d/%d tensors (%d%%)", self.label, self.done, self.total, pct)

    def _draw(self) -> None:
        width = 30
        filled = width * self.done // self.total
        bar = "#" * filled + "-" * (width - filled)
        self.stream.write(f"\r{self.label} [{bar}] {self.done}/{self.total} {time.monotonic() - self.start:.1f}s")
        self.stream.flush()

    def close(self) -> None:
        """The end of loading (tensors a model does not use are never counted, so done may be < total)."""
        if self._closed:
            return
        self._closed = True
        took = time.monotonic() - self.start
        if self.quiet:
            return
        if self.tty:
            self.done = self.total
            self._draw()
            self.stream.write("\n")
            self.stream.flush()
        else:
            log.info("%s: done, %d tensors in %.1f s", self.label, self.done, took)
