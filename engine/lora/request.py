"""The adapter a request names, as the engine loads it; the IPC contract (engine/messages.py) carries it."""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, frozen=True, array_like=True):
    """The adapter a request runs under: its name (for logs and metrics), folder, and content digest (sha256 of
    its files, engine/lora/peft_files.py): the engine loads by path, keys its caches on the digest, and refuses
    the request if the files no longer match it."""

    name: str
    path: str
    digest: str
