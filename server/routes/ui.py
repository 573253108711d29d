"""GET / and /ui: the chat page, and GET /ui/<asset>: its script and style (server/ui/, packaged with the server).

The page is static, hand-written and offline: every asset comes from here, and its Content-Security-Policy lets
it reach nothing but this server (no CDN, no fonts, no inline script). It uses relative URLs only, so it works
under --root-path. The one thing filled in per request is whether the model takes images (a vision model's page
offers an attach button). No API key is needed for these paths (server/http/deploy.py): the page asks for the key
and sends it with its API calls.
"""

from __future__ import annotations

from importlib.resources import files

from server.app_state import AppState
from server.http.asgi import Receive, Scope, Send

PAGE_PATHS = ("/", "/ui")
ASSETS = {
    "app.js": b"text/javascript; charset=utf-8",
    "markdown.js": b"text/javascript; charset=utf-8",
    "app.css": b"text/css; charset=utf-8",
}
ASSET_PATHS = tuple(f"/ui/{name}" for name in ASSETS)
PUBLIC_PATHS = PAGE_PATHS + ASSET_PATHS  # open without an API key
_VISION_MARK = b'data-vision="0"'
# The page may load its own script and style, show images it holds as data: URLs, and talk to this server only.
_CSP = (
    b"default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
    b"connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


def _read(name: str) -> bytes:
    return files("server").joinpath("ui", name).read_bytes()


async def _send(
    scope: Scope, send: Send, body: bytes, content_type: bytes, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    headers = [
        (b"content-type", content_type),
        (b"content-length", str(len(body)).encode()),
        (b"cache-control", b"no-cache"),
        (b"x-content-type-options", b"nosniff"),
        *(extra or []),
    ]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b"" if scope.get("method") == "HEAD" else body})


class PageRoute:
    """The chat page. `vision` at startup: the checkpoint folder says so (a loaded model's image worker also does)."""

    def __init__(self, state: AppState, vision: bool) -> None:
        self.state = state
        page = _read("index.html")
        if _VISION_MARK not in page:
            raise RuntimeError("server/ui/index.html lost its data-vision mark")
        self._pages = {False: page, True: page.replace(_VISION_MARK, b'data-vision="1"')}
        self._vision = vision

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        vision = self._vision or self.state.mm_pool is not None
        await _send(
            scope,
            send,
            self._pages[vision],
            b"text/html; charset=utf-8",
            [(b"content-security-policy", _CSP), (b"referrer-policy", b"no-referrer")],
        )


class AssetRoute:
    """One of the page's files, read once at startup."""

    def __init__(self, name: str) -> None:
        self.body = _read(name)
        self.content_type = ASSETS[name]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _send(scope, send, self.body, self.content_type)
