"""GET /version's answer: the installed package's version (0.0.0 from a source tree that is not installed)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from server.http.asgi import Receive, Scope, Send, send_json


def package_version() -> str:
    try:
        return version("spindle")
    except PackageNotFoundError:
        return "0.0.0"


async def send_version(scope: Scope, receive: Receive, send: Send) -> None:
    """`{"version": ...}`: the single server's /version route and the --models-dir front's."""
    await send_json(send, 200, b'{"version":"%s"}' % package_version().encode())
