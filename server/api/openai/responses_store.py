"""Stored responses (`store: true`): a bounded LRU per API process (--responses-store-size). Each entry keeps
the response object and the conversation's items up to it (earlier input, this input, this output), which
`previous_response_id` continues. An evicted or deleted id is a 404.

With --api-server-count > 1 each API process has its own store: a response is found only by the process that
answered it (not yet shared between processes).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from server.http.errors import APIError


@dataclass
class StoredResponse:
    response: dict[str, Any]
    items: list[Any]  # the conversation's items through this response's output


def not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(f"Response with id '{response_id}' not found.", status=404, param=param)


class ResponseStore:
    def __init__(self, size: int) -> None:
        self.size = size
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: StoredResponse) -> None:
        if self.size == 0:
            return
        self._entries[entry.response["id"]] = entry
        self._entries.move_to_end(entry.response["id"])
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        entry = self._entries.get(response_id)
        if entry is None:
            raise not_found(response_id, param)
        self._entries.move_to_end(response_id)
        return entry

    def history(self, response_id: str) -> list[Any]:
        """The conversation `previous_response_id` continues: a 404 unknown, a 400 not finished."""
        entry = self.get(response_id, "previous_response_id")
        status = entry.response["status"]
        if status not in ("completed", "incomplete"):
            raise APIError(f"Response '{response_id}' is {status}: only a completed or incomplete response can be "
                           "continued.", status=400, param="previous_response_id")
        return entry.items

    def delete(self, response_id: str) -> None:
        if self._entries.pop(response_id, None) is None:
            raise not_found(response_id)
