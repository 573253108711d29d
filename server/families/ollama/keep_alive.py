"""Ollama's `keep_alive`: how long a model stays loaded after a request. A number is seconds, a string a Go
duration ("5m", "1h30m", "300ms"); negative keeps it loaded forever, 0 unloads it once the request is done. With
--models-dir it sets the model's idle unload (server/fleet/loaded_set.py); a single model never unloads, and
/api/ps reports the time asked for as `expires_at`."""

from __future__ import annotations

import math
import re
import time
from datetime import UTC, datetime

from server.app_state import AppState
from server.http.errors import APIError, bad_request

KeepAlive = float | str | None  # as the request sends it

KEEPS_LOADED = frozenset(("/api/chat", "/api/generate", "/api/embed", "/api/embeddings"))  # take a keep_alive
FOREVER = "2318-08-24T00:00:00Z"  # what Ollama's /api/ps says of a model kept loaded without end
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+\.?\d*|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_DURATION = re.compile(r"[+-]?(?:(?:\d+\.?\d*|\.\d+)(?:ns|us|µs|μs|ms|s|m|h))+")


def _duration(text: str) -> float:
    """A Go duration string in seconds (time.ParseDuration's grammar: "0", or numbers each with a unit)."""
    text = text.strip()
    if text.lstrip("+-") == "0":
        return 0.0
    if not _DURATION.fullmatch(text):
        raise ValueError(text)
    seconds = sum(float(n) * _UNITS[unit] for n, unit in _PART.findall(text))
    return -seconds if text.startswith("-") else seconds


def keep_alive_seconds(value: KeepAlive) -> float | None:
    """Seconds to stay loaded (math.inf: forever); None when not given. A string that is no duration: 400."""
    if value is None:
        return None
    try:
        seconds = float(value) if not isinstance(value, str) else _duration(value)
    except ValueError:
        raise bad_request(
            f'keep_alive must be a number of seconds or a duration such as "5m", not {value!r}.', "keep_alive"
        ) from None
    return math.inf if seconds < 0 else seconds


def unloads(value: KeepAlive) -> bool:
    """keep_alive 0 (a number or a duration string): unload the model once the request is done."""
    try:
        return keep_alive_seconds(value) == 0
    except APIError:
        return False


def expires_at(until: float | None) -> str:
    """/api/ps's `expires_at` for a wall-clock deadline (None or inf: never)."""
    if until is None or math.isinf(until):
        return FOREVER
    return datetime.fromtimestamp(until, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def note_keep_alive(state: AppState, value: KeepAlive) -> None:
    """A request's keep_alive (400 when malformed) as the time /api/ps reports; without one, the server's own
    rule (a single model: never unloaded)."""
    seconds = keep_alive_seconds(value)
    state.keep_until = None if seconds is None else time.time() + seconds
