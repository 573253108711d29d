"""ServerEnv: the API process's tuning knobs that only a SPINDLE_* variable sets (no flag, not ServerConfig fields;
docs/serving.md lists them). Each module reads them here as it starts, so no other part of the server reads the
environment for a setting (tests/test_settings_layer.py)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

_OFF = ("0", "false", "no", "off")


@dataclass(frozen=True)
class ServerEnv:
    output_chunk: int = 128  # SPINDLE_OUTPUT_CHUNK: outputs processed between event-loop checkpoints
    direct_write: bool = True  # SPINDLE_DIRECT_WRITE=0 (false, no, off): every SSE chunk through Hypercorn's ASGI

    def __post_init__(self) -> None:
        if self.output_chunk < 1:
            raise ValueError(f"SPINDLE_OUTPUT_CHUNK must be at least 1, got {self.output_chunk}")

    @classmethod
    def read(cls, environ: Mapping[str, str] | None = None) -> ServerEnv:
        """One snapshot of the environment (a test's monkeypatch.setenv holds for what reads it next)."""
        env = os.environ if environ is None else environ
        chunk = env.get("SPINDLE_OUTPUT_CHUNK", "128")
        try:
            output_chunk = int(chunk)
        except ValueError:
            raise ValueError(f"SPINDLE_OUTPUT_CHUNK must be a whole number, not {chunk!r}") from None
        return cls(
            output_chunk=output_chunk, direct_write=env.get("SPINDLE_DIRECT_WRITE", "1").strip().lower() not in _OFF
        )
