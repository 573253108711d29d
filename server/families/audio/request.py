"""An audio route's form fields, checked: OpenAI's transcription / translation parameters and vLLM's sampling
fields (400s naming the field). The sampling fields travel as a ChatCompletionRequest so the chat route's checks
(server/request/input_processor.py check_request) bound them exactly as they bound chat."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgspec

from server.families.audio.formats import FORMATS, TIMESTAMPED
from server.families.audio.multipart import Form
from server.http.errors import APIError, bad_request, from_decode_error
from server.request.openai_protocol import ChatCompletionRequest

_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no", "")
GRANULARITIES = ("segment", "word")
INT_FIELDS = ("max_completion_tokens", "top_k", "seed")
FLOAT_FIELDS = ("top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty")
# the chat request's names for the form's fields, where they differ (a chat check's 400 names the form's field)
CHAT_NAMES = {"stream_options": "stream_include_usage", "max_tokens": "max_completion_tokens"}


@dataclass(frozen=True)
class AudioRequest:
    file: bytes
    model: str | None
    language: str | None
    prompt: str
    response_format: str
    temperature: float
    stream: bool
    sampling: ChatCompletionRequest  # max_completion_tokens, top_p, top_k, min_p, seed, penalties, stream_options
    to_language: str | None = None
    include_usage: bool = True  # stream_include_usage: a streamed answer's done event carries the usage


def form_error(error: APIError) -> APIError:
    """A chat check's 400 on the sampling fields, naming the form's field instead of the chat request's."""
    name = CHAT_NAMES.get(error.param or "")
    if name is None:
        return error
    return bad_request(error.message.replace(error.param or "", name), name)


def _optional_float(form: Form, name: str) -> float | None:
    raw = form.get(name)
    return None if raw is None or raw.strip() == "" else _float(form, name, 0.0)


def _int(form: Form, name: str) -> int | None:
    raw = (form.get(name) or "").strip()
    if raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise bad_request(f"{name} must be an integer, got {raw!r}", name) from None


def _sampling(form: Form, stream: bool) -> tuple[ChatCompletionRequest, bool]:
    """The sampling fields as a chat request (types and 64-bit bounds checked; ranges by check_request)."""
    fields: dict[str, Any] = {"stream": stream}
    for name in INT_FIELDS:
        fields[name] = _int(form, name)
    for name in FLOAT_FIELDS:
        fields[name] = _optional_float(form, name)
    include_usage = True
    if (form.get("stream_include_usage") or "").strip():
        include_usage = _bool(form, "stream_include_usage")
        fields["stream_options"] = {"include_usage": include_usage}
    try:
        return msgspec.convert(fields, ChatCompletionRequest), include_usage
    except msgspec.ValidationError as e:
        raise from_decode_error(e) from None


def _float(form: Form, name: str, default: float) -> float:
    raw = form.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise bad_request(f"{name} must be a number, got {raw!r}", name) from None
    if not math.isfinite(value):
        raise bad_request(f"{name} must be a finite number, got {raw!r}", name)
    return value


def _bool(form: Form, name: str) -> bool:
    raw = (form.get(name) or "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise bad_request(f"{name} must be true or false, got {raw!r}", name)


def _granularities(form: Form, fmt: str) -> None:
    values = form.fields.get("timestamp_granularities[]", []) + form.fields.get("timestamp_granularities", [])
    for v in values:
        if v not in GRANULARITIES:
            raise bad_request(
                f"timestamp_granularities[] accepts segment and word, not {v!r}", "timestamp_granularities"
            )
        if v == "word":
            raise bad_request(
                "word timestamps are not supported here: Whisper's timestamp tokens mark segments, "
                "and per-word times need cross-attention alignment (DTW over the alignment heads), "
                "which this server does not compute; ask for segment",
                "timestamp_granularities",
            )
    if values and fmt != "verbose_json":
        raise bad_request("timestamp_granularities[] needs response_format verbose_json", "timestamp_granularities")


def parse_form(form: Form) -> AudioRequest:
    """The form's fields (a missing or empty file, an unknown format, stream with a timestamped format: 400)."""
    if form.file is None:
        raise bad_request("the form has no `file` part; send the audio as the multipart field `file`", "file")
    fmt = (form.get("response_format") or "json").strip()
    if fmt not in FORMATS:
        raise bad_request(f"response_format must be one of {', '.join(FORMATS)}, got {fmt!r}", "response_format")
    temperature = _float(form, "temperature", 0.0)
    if not 0.0 <= temperature <= 1.0:
        raise bad_request(f"temperature must be in [0, 1], got {temperature:g}", "temperature")
    stream = _bool(form, "stream")
    if stream and fmt in TIMESTAMPED:
        raise bad_request(f"stream is not supported with response_format {fmt}; use json or text", "stream")
    _granularities(form, fmt)
    language = (form.get("language") or "").strip() or None
    sampling, include_usage = _sampling(form, stream)
    return AudioRequest(
        form.file,
        form.get("model"),
        language,
        (form.get("prompt") or "").strip(),
        fmt,
        temperature,
        stream,
        sampling,
        (form.get("to_language") or "").strip() or None,
        include_usage,
    )
