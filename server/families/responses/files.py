"""The Responses API's `input_file` content parts -> the text the model reads.

A file comes inline as `file_data`: base64, bare or as a data: URL, of UTF-8 text (source, Markdown, CSV, JSON,
...). It reaches the template as one text part, the file's name on a line before its text. Anything else is a
400 naming what is supported: `file_id` / `file_url` (no Files API, no fetching here), PDF and other binary
files (no document reader is installed).
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from server.http.errors import bad_request

SUPPORTED = "input_file is supported with file_data: base64 (or a data: URL) of a UTF-8 text file"


def _payload(data: str, param: str) -> tuple[str | None, bytes]:
    """(the data: URL's media type or None, the decoded bytes)."""
    media = None
    if data.startswith("data:"):
        head, comma, data = data[5:].partition(",")
        if not comma or not head.endswith(";base64"):
            raise bad_request(f"{param} must be base64: a data:<type>;base64,... URL or bare base64.", param)
        media = head[: -len(";base64")] or None
    try:
        return media, base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"{param} is not valid base64.", param) from None


def file_text(part: dict[str, Any], param: str) -> str:
    """An input_file part's text for the prompt (a 400 naming the field for what is not supported)."""
    for field in ("file_id", "file_url"):
        if part.get(field) is not None:
            raise bad_request(f"{param}.{field} is not supported (no Files API here); {SUPPORTED}.", f"{param}.{field}")
    data, name = part.get("file_data"), part.get("filename")
    if not isinstance(data, str):
        raise bad_request(f"{param}.file_data is required: {SUPPORTED}.", f"{param}.file_data")
    if name is not None and not isinstance(name, str):
        raise bad_request(f"{param}.filename must be a string.", f"{param}.filename")
    media, raw = _payload(data, f"{param}.file_data")
    if media == "application/pdf" or raw.startswith(b"%PDF-"):
        raise bad_request(
            f"{param}: PDF files are not supported (no PDF reader on this server); {SUPPORTED}.", f"{param}.file_data"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise bad_request(f"{param}: the file is not UTF-8 text; {SUPPORTED}.", f"{param}.file_data") from None
    if "\x00" in text:
        raise bad_request(f"{param}: the file is binary (it holds NUL bytes); {SUPPORTED}.", f"{param}.file_data")
    return f"{name}:\n{text}" if name else text
