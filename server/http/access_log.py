"""One access-log line per HTTP request: id, route, status, tokens, TTFT, duration, finish reason.

The middleware opens a `RequestRecord` in a context variable; `AsyncLLM.generate` (same task, or a
child task that inherits the context) fills in the token counts, so routes need no logging code.
Prompt and output text are logged only with --log-requests. Request ids, method and path come from the
client: control characters, quotes and backslashes (and spaces in ids) are escaped, so they cannot forge log lines.
/health probes are logged at DEBUG, not INFO (load balancers poll it).
"""

from __future__ import annotations

import contextvars
import logging
import time
from typing import Any

from server.http.asgi import Message, Receive, Scope, Send

log = logging.getLogger("spindle.access")


class RequestRecord:
    """What one HTTP request did; `generate` fills the token fields, the middleware the rest."""

    __slots__ = (
        "request_id",
        "prompt_tokens",
        "completion_tokens",
        "first_token",
        "finish_reasons",
        "log_text",
        "texts",
    )

    def __init__(self, log_text: bool) -> None:
        self.request_id: str | None = None
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.first_token = 0.0  # monotonic time of the first output token (0: none)
        self.finish_reasons: list[str] = []
        self.log_text = log_text  # --log-requests: keep the output text for the log line
        self.texts: dict[int, str] = {}


current: contextvars.ContextVar[RequestRecord | None] = contextvars.ContextVar("spindle_request", default=None)


_ID_UNSAFE = ' "\\'  # a space in an id would start a forged field


def _clean(text: str, unsafe: str = '"\\') -> str:
    """`text` with non-printable characters and those in `unsafe` backslash-escaped: one line, one field."""
    if text.isprintable() and not any(c in text for c in unsafe):
        return text
    return "".join(c if c.isprintable() and c not in unsafe else _escape(c) for c in text)


def _escape(c: str) -> str:
    if c in '"\\':
        return "\\" + c
    return c.encode("unicode_escape").decode("ascii") if c != " " else "\\x20"  # \n, \x1b, \u2028


def _fmt_s(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


class AccessLog:
    """ASGI middleware: logs at INFO on `spindle.access` after each HTTP request ends (however it ends)."""

    def __init__(self, app: Any, *, log_requests: bool = False) -> None:
        self.app = app
        self.log_requests = log_requests

    def __getattr__(self, name: str) -> Any:  # app.state_holder and friends stay reachable through the wrapper
        return getattr(self.app, name)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        level = logging.DEBUG if scope.get("path") == "/health" else logging.INFO
        if scope["type"] != "http" or not log.isEnabledFor(level):
            await self.app(scope, receive, send)
            return
        record = RequestRecord(self.log_requests)
        token = current.set(record)
        start = time.monotonic()
        status = 0
        body_parts: list[bytes] = []
        header_id: str | None = None

        async def logged_receive() -> Message:
            message = await receive()
            if self.log_requests and message["type"] == "http.request":
                body_parts.append(message.get("body", b""))
            return message

        async def logged_send(message: Message) -> None:
            nonlocal status, header_id
            if message["type"] == "http.response.start":
                status = message["status"]
                for key, value in message.get("headers", ()):
                    if key == b"x-request-id":
                        header_id = value.decode("latin-1")
            await send(message)

        try:
            await self.app(scope, logged_receive if self.log_requests else receive, logged_send)
        finally:
            current.reset(token)
            self._write(level, scope, record, status, start, header_id, b"".join(body_parts))

    def _write(
        self, level: int, scope: Scope, r: RequestRecord, status: int, start: float, header_id: str | None, body: bytes
    ) -> None:
        now = time.monotonic()
        ttft = r.first_token - start if r.first_token else None
        finish = ",".join(sorted(set(r.finish_reasons))) or "-"
        # status 0: the client left before any response started
        line = (
            f"request_id={_clean(r.request_id or header_id or '-', _ID_UNSAFE)} "
            f'route="{_clean(scope.get("method", ""))} {_clean(scope["path"])}" '
            f"status={status} prompt_tokens={r.prompt_tokens} completion_tokens={r.completion_tokens} "
            f"ttft={_fmt_s(ttft)} duration={_fmt_s(now - start)} finish_reason={finish}"
        )
        if r.log_text:
            texts = [r.texts[i] for i in sorted(r.texts)]
            line += f" request_body={body.decode('utf-8', 'replace')!r} output={texts!r}"
        log.log(level, "%s", line)
