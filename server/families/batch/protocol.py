"""The Batch API's request bodies and query strings."""

from __future__ import annotations

from urllib.parse import parse_qsl

import msgspec

from server.families.batch.lines import ENDPOINTS
from server.http.asgi import Scope
from server.http.errors import APIError

MAX_METADATA = 16  # OpenAI's: up to 16 pairs, keys up to 64 characters, values up to 512


class CreateBatch(msgspec.Struct, forbid_unknown_fields=True):
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None

    def check(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise APIError(f"endpoint must be one of {', '.join(ENDPOINTS)}; got {self.endpoint!r}", param="endpoint")
        if self.completion_window != "24h":
            raise APIError(
                f"completion_window must be '24h'; got {self.completion_window!r}", param="completion_window"
            )
        metadata = self.metadata or {}
        if len(metadata) > MAX_METADATA or any(len(k) > 64 or len(v) > 512 for k, v in metadata.items()):
            raise APIError(
                f"metadata holds at most {MAX_METADATA} pairs, keys up to 64 characters, values up to 512",
                param="metadata",
            )


create_decoder = msgspec.json.Decoder(CreateBatch)


def query(scope: Scope) -> dict[str, str]:
    return dict(parse_qsl(scope.get("query_string", b"").decode("latin-1")))
