"""The API's error body: `{"error": {"message", "type", "param", "code"}}`, as OpenAI and vLLM send it."""

from __future__ import annotations

from typing import Any

import httpx


def assert_error(r: httpx.Response, status: int, *needles: str, param: str | None = None) -> dict[str, Any]:
    """`r` is a `status` error in the OpenAI shape whose message holds every needle (and names `param`, if given)."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status, err
    for needle in needles:
        assert needle in err["message"], err["message"]
    if param is not None:
        assert err["param"] == param, err
    return dict(err)
