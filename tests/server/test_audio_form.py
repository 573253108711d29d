"""server/families/audio/multipart.py and request.py: the multipart form read under the size cap (at, under, over),
malformed bodies, and the fields' checks: vLLM's sampling fields at, under and over the chat route's bounds."""

from __future__ import annotations

from typing import Any

import anyio
import httpx
import pytest

from engine.messages import SamplingParams
from server.families.audio.multipart import Form, read_form
from server.families.audio.request import form_error, parse_form
from server.families.audio.transcriptions import audio_params
from server.http.errors import APIError
from server.request.input_processor import ModelLimits, check_request


def _multipart(files: dict[str, Any] | None, data: dict[str, Any] | None) -> tuple[str, bytes]:
    req = httpx.Request("POST", "http://x/", files=files, data=data)
    return req.headers["content-type"], req.read()


def _read(ctype: str, body: bytes, cap_mb: float, chunk: int = 7_000) -> Form:
    parts = [body[i : i + chunk] for i in range(0, len(body), chunk)] or [b""]
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
    ctype, body = _multipart(
        {"file": ("a.wav", b"RIFF....")}, {"model": "m", "timestamp_granularities[]": ["segment"], "language": "en"}
    )
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
    cut = _read(ctype, body[: len(body) // 2], 1.0)  # the body ends mid-part: no file part completed
    assert cut.file is None
    ctype, body = _multipart({"file": ("a", b"x")}, {"prompt": "p" * 20_000})
    with pytest.raises(APIError, match="prompt"):
        _read(ctype, body, 1.0)


def _form(**fields: str | list[str]) -> Form:
    return Form({k: v if isinstance(v, list) else [v] for k, v in fields.items()}, b"audio", "a.wav")


def test_parse_form() -> None:
    req = parse_form(_form(response_format="srt", temperature="0.5", language="fr", prompt=" hi "))
    assert (req.response_format, req.temperature, req.language, req.prompt, req.stream) == (
        "srt",
        0.5,
        "fr",
        "hi",
        False,
    )
    assert parse_form(_form(stream="true")).stream
    for fields, words in [
        ({"response_format": "xml"}, "response_format"),
        ({"temperature": "1.01"}, "temperature"),
        ({"temperature": "nan"}, "temperature"),
        ({"stream": "maybe"}, "stream"),
        ({"stream": "true", "response_format": "verbose_json"}, "stream"),
        ({"timestamp_granularities[]": "word", "response_format": "verbose_json"}, "word"),
        ({"timestamp_granularities[]": "segment"}, "verbose_json"),
        ({"timestamp_granularities[]": "char", "response_format": "verbose_json"}, "segment"),
    ]:
        with pytest.raises(APIError, match=words):
            parse_form(_form(**fields))
    assert parse_form(_form(temperature="1")).temperature == 1.0
    with pytest.raises(APIError, match="no `file`"):
        parse_form(Form({}, None))


LIMITS = ModelLimits(max_model_len=68, vocab_size=100)
PROMPT = [1, 2, 3, 4]  # a 4-token decoder prompt: 64 tokens of room

# field -> (values at or within its bound, values past it): the chat route's ranges (check_request)
BOUNDS: dict[str, tuple[list[str], list[str]]] = {
    "max_completion_tokens": (["1", "16", "64"], ["0", "-1", "65"]),
    "top_p": (["1", "0.5", "1e-9"], ["0", "1.0001", "-0.1"]),
    "top_k": (["-1", "0", "1", "50"], ["-2"]),
    "min_p": (["0", "1", "0.5"], ["-0.01", "1.01"]),
    "seed": (["0", str((1 << 63) - 1), str(-(1 << 63))], [str(1 << 63)]),
    "frequency_penalty": (["-2", "2", "0"], ["-2.01", "2.01"]),
    "presence_penalty": (["-2", "2", "0"], ["-2.01", "2.01"]),
    "repetition_penalty": (["2", "0.01", "1"], ["0", "2.01", "-1"]),
}


def _checked(**fields: str) -> SamplingParams:
    req = parse_form(_form(**fields))
    try:
        check_request(req.sampling, LIMITS)
    except APIError as e:
        raise form_error(e) from None
    return audio_params(req, PROMPT, LIMITS)


@pytest.mark.parametrize("name", list(BOUNDS))
def test_sampling_fields_at_under_over(name: str) -> None:
    ok, bad = BOUNDS[name]
    for value in ok:
        params = _checked(**{name: value})
        got = params.max_tokens if name == "max_completion_tokens" else getattr(params, name)
        assert got == (int(value) if name in ("max_completion_tokens", "top_k", "seed") else float(value))
    for value in bad:
        with pytest.raises(APIError) as e:
            _checked(**{name: value})
        assert e.value.status == 400 and e.value.param == name, (value, e.value.message)
    with pytest.raises(APIError, match=name) as e:
        _checked(**{name: "abc"})
    assert e.value.param == name


def test_sampling_defaults_and_types() -> None:
    params = _checked()
    assert (params.max_tokens, params.top_p, params.top_k, params.min_p, params.seed) == (64, 1.0, 0, 0.0, None)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.0, 0.0, 1.0)
    with pytest.raises(APIError, match="integer") as e:
        _checked(top_k="1.5")
    assert e.value.param == "top_k"
    with pytest.raises(APIError) as e:
        _checked(top_p="inf")
    assert e.value.param == "top_p"


def test_stream_include_usage() -> None:
    assert parse_form(_form()).include_usage and parse_form(_form(stream="true")).include_usage
    assert not parse_form(_form(stream="true", stream_include_usage="false")).include_usage
    assert parse_form(_form(stream="true", stream_include_usage="true")).include_usage
    with pytest.raises(APIError, match="stream_include_usage is only allowed when stream is true") as e:
        _checked(stream_include_usage="true")
    assert e.value.param == "stream_include_usage"
    with pytest.raises(APIError, match="stream_include_usage"):
        parse_form(_form(stream="true", stream_include_usage="often"))
    assert parse_form(_form(to_language=" fr ")).to_language == "fr"
