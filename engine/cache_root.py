"""Where spindle keeps what it builds once per machine: the demo checkpoints, tokenizers, compiled CPU kernels."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$SPINDLE_CACHE_DIR, else ~/.cache/spindle."""
    return Path(os.environ.get("SPINDLE_CACHE_DIR") or Path.home() / ".cache" / "spindle")
