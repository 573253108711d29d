"""The 503s: every "not now, retry" answer, worded once, each with Retry-After (a client's backoff hint)."""

from __future__ import annotations

from server.http.errors import APIError

RETRY_AFTER = 1  # seconds


def unavailable(message: str) -> APIError:
    return APIError(message, status=503, retry_after=RETRY_AFTER)


def starting(stage: str = "") -> APIError:
    """stage: what start-up is doing (server/app_state.py AppState.stage)."""
    return unavailable(f"The server is still starting{f' ({stage})' if stage else ''}; retry in a moment.")


def shutting_down() -> APIError:
    return unavailable("The server is shutting down; retry against another instance.")


def engine_dead(why: str) -> APIError:
    return unavailable(f"The engine is not running ({why}); retry against a restarted server.")


def overloaded(reason: str) -> APIError:
    """Admission, or a worker pool's queue, is full."""
    return unavailable(f"The server is overloaded ({reason}); retry after a moment.")
