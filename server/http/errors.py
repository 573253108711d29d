"""Errors users see: one exception type carrying the HTTP status, and the two error bodies: OpenAI's
(`{"error": {"message", "type", "param", "code"}}`) and Anthropic's (`{"type": "error", "error": {...}}`).
Defined here, below the wire protocols, because the transport itself answers with them (401, 404, 413)."""

from __future__ import annotations

import re
from http import HTTPStatus

import msgspec

_encoder = msgspec.json.Encoder()

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "BadRequestError",
    408: "TimeoutError",
    413: "BadRequestError",
    415: "BadRequestError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: int | str | None


class ErrorResponse(msgspec.Struct):
    error: ErrorInfo


class APIError(Exception):
    """Raised anywhere in request handling; the route turns it into an OpenAI error response."""

    def __init__(
        self, message: str, *, status: int = 400, param: str | None = None, retry_after: int | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.retry_after = retry_after  # seconds, for 503: the Retry-After header

    def info(self) -> ErrorInfo:
        return ErrorInfo(
            message=self.message,
            type=_TYPES.get(self.status, HTTPStatus(self.status).phrase),
            param=self.param,
            code=self.status,
        )

    def body(self) -> bytes:
        return _encoder.encode(ErrorResponse(self.info()))


# Anthropic's error types by HTTP status (docs.claude.com/en/api/errors); our 503s (loading, queue full,
# stopping) are its `overloaded_error`: temporary, retry later.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def anthropic_error_type(status: int) -> str:
    return _ANTHROPIC_TYPES.get(status) or ("invalid_request_error" if status < 500 else "api_error")


class AnthropicErrorDetail(msgspec.Struct):
    type: str
    message: str


class AnthropicErrorResponse(msgspec.Struct, tag_field="type", tag="error"):
    error: AnthropicErrorDetail


def anthropic_error_body(status: int, message: str) -> bytes:
    """`{"type": "error", "error": {"type", "message"}}`: the HTTP body and the stream's `error` event alike."""
    return _encoder.encode(AnthropicErrorResponse(AnthropicErrorDetail(anthropic_error_type(status), message)))


def ollama_error_body(message: str) -> bytes:
    """Ollama's `{"error": "message"}`: the HTTP body and a stream's last line alike."""
    return _encoder.encode({"error": message})


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(message, status=400, param=param)


_PATH = re.compile(r" - at `\$\.?([^`]*)`$")


_INT64_BOUNDS = {f"Expected `int` <= {(1 << 63) - 1}", f"Expected `int` >= {-(1 << 63)}"}


def from_decode_error(error: msgspec.DecodeError) -> APIError:
    """msgspec's 'Expected `int`, got `str` - at `$.max_tokens`' -> a 400 naming the field."""
    text = str(error)
    m = _PATH.search(text)
    param = m.group(1) if m and m.group(1) else None
    if isinstance(error, msgspec.ValidationError):
        message = _PATH.sub("", text)
        if message in _INT64_BOUNDS:  # the protocol's Int64 bound: say what it means, not the number
            message = "Expected an integer that fits in 64 bits (signed)"
        message = f"{param}: {message}" if param else message
        return bad_request(f"Invalid request: {message}; see the OpenAI API reference for the field's type.", param)
    return bad_request(f"The request body is not valid JSON ({text}); send a JSON object.")


def describe_exception(error: BaseException) -> str:
    """For logs: the messages of the exceptions at the leaves of (nested) exception groups."""
    if isinstance(error, BaseExceptionGroup):
        return "; ".join(describe_exception(e) for e in error.exceptions)
    return f"{type(error).__name__}: {error}"
