"""Ollama's keep_alive values as Ollama's api.Duration reads them: numbers are seconds, strings Go durations,
negative is forever; anything else is a 400 naming keep_alive."""

from __future__ import annotations

import math

import pytest

from server.families.ollama.keep_alive import FOREVER, expires_at, keep_alive_seconds, unloads
from server.http.errors import APIError


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (None, None),
        (0, 0.0),
        ("0", 0.0),
        ("0s", 0.0),
        (300, 300.0),
        (1.5, 1.5),
        ("5m", 300.0),
        ("1h30m", 5400.0),
        ("300ms", 0.3),
        ("1.5h", 5400.0),
        ("2m3.5s", 123.5),
        (-1, math.inf),
        ("-1m", math.inf),
    ],
)
def test_values(value: float | str | None, seconds: float | None) -> None:
    got = keep_alive_seconds(value)
    assert got == pytest.approx(seconds) if seconds is not None else got is None


@pytest.mark.parametrize("value", ["soon", "5", "5 m", "m", "1d", "", "5m-"])
def test_malformed_is_a_400(value: str) -> None:
    with pytest.raises(APIError) as e:
        keep_alive_seconds(value)
    assert e.value.status == 400 and "keep_alive" in e.value.message
    assert not unloads(value)


def test_unloads_and_expires_at() -> None:
    assert unloads(0) and unloads("0s") and not unloads("5m") and not unloads(None)
    assert expires_at(None) == expires_at(math.inf) == FOREVER
    assert expires_at(0.0) == "1970-01-01T00:00:00.000000Z"
