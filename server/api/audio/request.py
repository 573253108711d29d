"""An audio route's form fields, checked: OpenAI's transcription / translation parameters (400s naming the field)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from server.api.audio.formats import FORMATS, TIMESTAMPED
from server.api.audio.multipart import Form
from server.http.errors import bad_request

_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no", "")
GRANULARITIES = ("segment", "word")


@dataclass(frozen=True)
class AudioRequest:
    file: bytes
    model: str | None
    language: str | None
    prompt: str
    response_format: str
    temperature: float
    stream: bool


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
            raise bad_request(f"timestamp_granularities[] accepts segment and word, not {v!r}",
                              "timestamp_granularities")
        if v == "word":
            raise bad_request("word timestamps are not supported here: Whisper's timestamp tokens mark segments, "
                              "and per-word times need cross-attention alignment (DTW over the alignment heads), "
                              "which this server does not compute; ask for segment", "timestamp_granularities")
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
    return AudioRequest(form.file, form.get("model"), language, (form.get("prompt") or "").strip(), fmt,
                        temperature, stream)
