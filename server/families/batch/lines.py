"""A batch's input file read into requests. A bad line (not JSON, no custom_id or a repeated one, another
endpoint, not POST, no body object, a stream) never fails the batch: it becomes an error line."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")


@dataclass(frozen=True)
class Line:
    number: int  # 1-based, as the batch's `errors` name it
    custom_id: str
    body: dict[str, Any]


@dataclass(frozen=True)
class BadLine:
    number: int
    custom_id: str | None
    code: str
    message: str

    def error(self) -> dict[str, Any]:
        """The entry of the batch's `errors.data`."""
        return {"code": self.code, "message": self.message, "param": None, "line": self.number}


def read_lines(data: bytes, endpoint: str) -> tuple[list[Line], list[BadLine]]:
    good: list[Line] = []
    bad: list[BadLine] = []
    seen: set[str] = set()
    for number, raw in enumerate(data.splitlines(), 1):
        if not raw.strip():
            continue
        parsed = _parse(number, raw, endpoint, seen)
        if isinstance(parsed, BadLine):
            bad.append(parsed)
        else:
            seen.add(parsed.custom_id)
            good.append(parsed)
    return good, bad


def _parse(number: int, raw: bytes, endpoint: str, seen: set[str]) -> Line | BadLine:
    try:
        item = json.loads(raw)
    except ValueError as e:
        return BadLine(number, None, "invalid_json_line", f"Line {number} is not valid JSON: {e}")
    if not isinstance(item, dict):
        return BadLine(number, None, "invalid_json_line", f"Line {number} is not a JSON object.")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return BadLine(number, None, "missing_required_parameter", f"Line {number} has no custom_id.")
    if custom_id in seen:
        return BadLine(number, custom_id, "duplicate_custom_id", f"custom_id {custom_id!r} is used more than once.")
    return _check_request(number, custom_id, item, endpoint)


def _check_request(number: int, custom_id: str, item: dict[str, Any], endpoint: str) -> Line | BadLine:
    url, method, body = item.get("url"), item.get("method"), item.get("body")
    if url != endpoint:
        return BadLine(
            number, custom_id, "invalid_url", f"Line {number}'s url {url!r} is not the batch's endpoint {endpoint}."
        )
    if method != "POST":
        return BadLine(number, custom_id, "invalid_method", f"Line {number}'s method must be POST; got {method!r}.")
    if not isinstance(body, dict):
        return BadLine(number, custom_id, "invalid_body", f"Line {number}'s body must be a JSON object.")
    if body.get("stream"):
        return BadLine(number, custom_id, "invalid_body", f"Line {number} asks for a stream; a batch line cannot.")
    return Line(number, custom_id, body)
