"""Errors users see: one exception type carrying the HTTP status and the OpenAI error body."""

from __future__ import annotations

import re
from http import HTTPStatus

import msgspec

from server.protocol.openai import ErrorInfo, ErrorResponse, encoder

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "BadRequestError",
          408: "TimeoutError", 413: "BadRequestError", 415: "BadRequestError", 500: "InternalServerError", 503: "ServiceUnavailableError"}


class APIError(Exception):
    """Raised anywhere in request handling; the route turns it into an OpenAI error response."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 retry_after: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.retry_after = retry_after  # seconds, for 503: the Retry-After header

    def info(self) -> ErrorInfo:
        return ErrorInfo(message=self.message, type=_TYPES.get(self.status, HTTPStatus(self.status).phrase),
                         param=self.param, code=self.status)

    def body(self) -> bytes:
        return encoder.encode(ErrorResponse(self.info()))


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
