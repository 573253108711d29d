"""The access log: client-sent ids and paths cannot forge lines, /health probes stay out of INFO."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from server.http.access_log import AccessLog

pytestmark = pytest.mark.anyio


async def call(path: str, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": headers or []})
        await send({"type": "http.response.body", "body": b""})

    async def receive() -> Any:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Any) -> None:
        pass

    scope = {"type": "http", "method": "GET", "path": path, "headers": []}
    await AccessLog(app)(scope, receive, send)


async def test_control_characters_in_request_ids_and_paths_are_escaped(caplog: pytest.LogCaptureFixture) -> None:
    forged = b'abc\nrequest_id=evil route="GET /" status=200\x1b[2J'
    with caplog.at_level(logging.INFO, logger="spindle.access"):
        await call('/v1/x\r\ny"z\u2028', [(b"x-request-id", forged)])
    (record,) = caplog.records
    line = record.getMessage()
    assert "\n" not in line and "\r" not in line and "\x1b" not in line and "\u2028" not in line
    assert line.startswith(r"request_id=abc\nrequest_id=evil\x20route=\"GET\x20/\"\x20status=200\x1b[2J ")
    assert r'route="GET /v1/x\r\ny\"z\u2028" status=200' in line


async def test_a_plain_request_id_is_logged_as_sent(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="spindle.access"):
        await call("/v1/models", [(b"x-request-id", b"req-42_\xc3\xa9")])
    assert caplog.records[0].getMessage().startswith('request_id=req-42_\xc3\xa9 route="GET /v1/models" status=200')


async def test_health_probes_are_logged_at_debug_only(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="spindle.access"):
        await call("/health")
        await call("/v1/models")
    assert [r.getMessage().split('"')[1] for r in caplog.records] == ["GET /v1/models"]
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="spindle.access"):
        await call("/health")
    (record,) = caplog.records
    assert record.levelno == logging.DEBUG and 'route="GET /health" status=200' in record.getMessage()
