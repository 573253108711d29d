"""--root-path: the prefix a path-prefix proxy serves this server under (ASGI `root_path`)."""

from __future__ import annotations

from typing import Any


def route_path(scope: Any) -> str:
    """The path routes see: with --root-path, the request path without that prefix (if it has it)."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if root and path.startswith(root) and (len(path) == len(root) or path[len(root)] == "/"):
        return path[len(root) :] or "/"
    return path


class RootPath:
    """Sets the ASGI root_path on every scope (also when served by a plain `hypercorn` without --root-path)."""

    def __init__(self, app: Any, root_path: str) -> None:
        self.app = app
        self.root_path = root_path

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket"):
            scope = dict(scope)
            scope["root_path"] = self.root_path
        await self.app(scope, receive, send)
