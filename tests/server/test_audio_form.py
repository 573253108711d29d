"""server/api/audio/multipart.py and request.py: the multipart form read under the size cap (at, under, over),
malformed bodies, and the fields' checks."""

from __future__ import annotations

from typing import Any

import anyio
import httpx
import pytest

from server.api.audio.multipart import Form, read_form
from server.api.audio.request import parse_form
from server.http.errors import APIError


def _multipart(files: dict[str, Any] | None, data: dict[str, Any] | None) -> tuple[str, bytes]:
    req = httpx.Request("POST", "http://x/", files=files, data=data)
    return req.headers["content-type"], req.read()


def _read(ctype: str, body: bytes, cap_mb: float, chunk: int = 7_000) -> Form:
    parts = [body[i:i + chunk] for i in range(0, len(body), chunk)] or [b""]
    sent = 0

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent >= len(parts):
            return {"type": "http.disconnect"}
        sent += 1
        return {"type": "http.request", "body": parts[sent - 1], "more_body": sent < len(parts)}

    scope = {"headers": [(b"content-type", ctype.encode())]}
    return anyio.run(read_form, scope, receive, cap_mb)


def test_fields_and_file() -> None:
    ctype, body = _multipart({"file": ("a.wav", b"RIFF....")},
                             {"model": "m", "timestamp_granularities[]": ["segment"], "language": "en"})
    form = _read(ctype, body, 1.0)
    assert form.file == b"RIFF...." and form.filename == "a.wav"
    assert form.get("model") == "m" and form.fields["timestamp_granularities[]"] == ["segment"]


def test_file_cap_at_under_over() -> None:
    cap = 0.05  # 50,000 bytes
    for size, ok in ((50_000, True), (49_999, True), (50_001, False)):
        ctype, body = _multipart({"file": ("a.wav", b"\1" * size)}, {"model": "m"})
        if ok:
            assert len(_read(ctype, body, cap).file or b"") == size
        else:
            limit = r"larger than the server's limit of 0.05 MB \(--max-audio-filesize-mb\)"
            with pytest.raises(APIError, match=limit):
                _read(ctype, body, cap)


def test_a_huge_body_is_refused_as_it_streams() -> None:
    ctype, body = _multipart({"file": ("a.wav", b"\1" * 400_000)}, None)
    with pytest.raises(APIError, match="--max-audio-filesize-mb"):
        _read(ctype, body, 0.05, chunk=10_000)


def test_bad_bodies() -> None:
    with pytest.raises(APIError) as e:
        _read("application/json", b"{}", 1.0)
    assert e.value.status == 415
    with pytest.raises(APIError, match="no boundary"):
        _read("multipart/form-data", b"x", 1.0)
    ctype, _ = _multipart({"file": ("a", b"x")}, None)
    with pytest.raises(APIError, match="malformed"):
        _read(ctype, b"this is not a multipart body\r\n" * 3, 1.0)
    ctype, body = _multipart({"file": ("a", b"x" * 100)}, None)
    cut = _read(ctype, body[:len(body) // 2], 1.0)  # the body ends mid-part: no file part completed
    assert cut.file is None
    ctype, body = _multipart({"file": ("a", b"x")}, {"prompt": "p" * 20_000})
    with pytest.raises(APIError, match="prompt"):
        _read(ctype, body, 1.0)


def _form(**fields: str | list[str]) -> Form:
    return Form({k: v if isinstance(v, list) else [v] for k, v in fields.items()}, b"audio", "a.wav")


def test_parse_form() -> None:
    req = parse_form(_form(response_format="srt", temperature="0.5", language="fr", prompt=" hi "))
    assert (req.response_format, req.temperature, req.language, req.prompt, req.stream) == ("srt", 0.5, "fr", "hi",
                                                                                           False)
    assert parse_form(_form(stream="true")).stream
    for fields, words in [({"response_format": "xml"}, "response_format"), ({"temperature": "1.01"}, "temperature"),
                          ({"temperature": "nan"}, "temperature"), ({"stream": "maybe"}, "stream"),
                          ({"stream": "true", "response_format": "verbose_json"}, "stream"),
                          ({"timestamp_granularities[]": "word", "response_format": "verbose_json"}, "word"),
                          ({"timestamp_granularities[]": "segment"}, "verbose_json"),
                          ({"timestamp_granularities[]": "char", "response_format": "verbose_json"}, "segment")]:
        with pytest.raises(APIError, match=words):
            parse_form(_form(**fields))
    assert parse_form(_form(temperature="1")).temperature == 1.0
    with pytest.raises(APIError, match="no `file`"):
        parse_form(Form({}, None))
