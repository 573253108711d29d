"""OpenAI's multipart/form-data audio request, read with python-multipart's streaming parser (Starlette's) under a
byte cap: the body is parsed as it arrives and refused (400 naming --max-audio-filesize-mb) as soon as it passes
the cap, so an oversized upload is never held whole."""

from __future__ import annotations

from dataclasses import dataclass, field

from python_multipart.multipart import MultipartParser, parse_options_header

from server.http.asgi import BodyReader, Receive, Scope, header
from server.http.errors import APIError, bad_request

FORM_SLACK = 64 << 10  # bytes of form fields and part headers allowed beyond the file's cap
MAX_FIELD = 16 << 10  # one text field's bytes


@dataclass
class Form:
    fields: dict[str, list[str]] = field(default_factory=dict)  # name -> values (timestamp_granularities[] repeats)
    file: bytes | None = None
    filename: str | None = None

    def get(self, name: str) -> str | None:
        values = self.fields.get(name)
        return values[-1] if values else None


class _Collector:
    """python-multipart's callbacks -> a Form."""

    def __init__(self, file_cap: int, cap_mb: float) -> None:
        self.form = Form()
        self.file_cap, self.cap_mb = file_cap, cap_mb
        self._header_field = b""
        self._header_value = b""
        self._headers: dict[bytes, bytes] = {}
        self._data = bytearray()

    def on_part_begin(self) -> None:
        self._headers, self._data = {}, bytearray()

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_field += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]

    def on_header_end(self) -> None:
        self._headers[self._header_field.lower()] = self._header_value
        self._header_field, self._header_value = b"", b""

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        self._data += data[start:end]
        name, filename = self._disposition()
        if filename is not None and len(self._data) > self.file_cap:
            raise bad_request(
                f"the audio file is larger than the server's limit of {self.cap_mb:g} MB (--max-audio-filesize-mb)",
                "file",
            )
        if filename is None and len(self._data) > MAX_FIELD:
            raise bad_request(f"the form field {name!r} is longer than {MAX_FIELD} bytes", name or None)

    def _disposition(self) -> tuple[str, str | None]:
        _, opts = parse_options_header(self._headers.get(b"content-disposition", b""))
        name = opts.get(b"name", b"").decode("utf-8", "replace")
        filename = opts.get(b"filename")
        return name, filename.decode("utf-8", "replace") if filename is not None else None

    def on_part_end(self) -> None:
        name, filename = self._disposition()
        if filename is not None or name == "file":
            self.form.file, self.form.filename = bytes(self._data), filename
        else:
            self.form.fields.setdefault(name, []).append(self._data.decode("utf-8", "replace"))


async def read_form(scope: Scope, receive: Receive, cap_mb: float) -> Form:
    """The request's form; 415 for another content type, 400 for a malformed body or a file over the cap."""
    ctype = header(scope, b"content-type") or ""
    media, opts = parse_options_header(ctype)
    if media != b"multipart/form-data":
        raise APIError(
            f"Content-Type {ctype.split(';')[0] or '(none)'!r} is not supported here; send the audio as "
            "multipart/form-data",
            status=415,
        )
    boundary = opts.get(b"boundary")
    if not boundary:
        raise bad_request("the multipart/form-data Content-Type has no boundary")
    file_cap = int(cap_mb * 1_000_000)
    collector = _Collector(file_cap, cap_mb)
    callbacks = {
        name: getattr(collector, name)
        for name in (
            "on_part_begin",
            "on_header_field",
            "on_header_value",
            "on_header_end",
            "on_part_data",
            "on_part_end",
        )
    }
    parser = MultipartParser(boundary, callbacks, max_size=file_cap + FORM_SLACK)  # type: ignore[arg-type]
    reader = BodyReader(
        receive,
        file_cap + FORM_SLACK,
        lambda: bad_request(
            f"the audio file is larger than the server's limit of {cap_mb:g} MB (--max-audio-filesize-mb)", "file"
        ),
    )
    while reader.more:
        chunk = await reader.next()
        try:
            parser.write(chunk)
            if not reader.more:
                parser.finalize()
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001 - python-multipart's errors are all the client's malformed body
            raise bad_request(f"the multipart body is malformed ({type(e).__name__}: {e})") from None
    return collector.form
