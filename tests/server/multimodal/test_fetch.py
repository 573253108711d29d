"""Image URLs: http(s) only from --allowed-media-domains hosts, capped, timed, no redirect off the list; every
other scheme refused. A real HTTP server on 127.0.0.1 (a thread) answers; "localhost" is the host not listed."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from server.http.errors import APIError
from server.multimodal import images

pytestmark = pytest.mark.anyio

BODY = b"\x89PNG not really, bytes are bytes here"
RELEASE = threading.Event()  # the /hang handler waits on it; set at teardown


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        port = self.server.server_address[1]
        routes = {
            "/img": (200, BODY, None),
            "/missing": (404, b"", None),
            "/to-img": (302, b"", "/img"),
            "/to-localhost": (302, b"", f"http://localhost:{port}/img"),
            "/loop": (302, b"", "/loop"),
            "/big": (200, b"x" * 2048, None),
        }
        if self.path == "/hang":
            RELEASE.wait(30)
            return
        status, body, location = routes[self.path]
        self.send_response(status)
        if location:
            self.send_header("Location", location)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    RELEASE.set()
    server.shutdown()


ALLOWED = ("127.0.0.1",)


async def refused(url: str, allowed: tuple[str, ...] = ALLOWED) -> str:
    with pytest.raises(APIError) as e:
        await images.load_image(url, allowed)
    assert e.value.status == 400
    return e.value.message


async def test_an_allowed_host_is_fetched_and_may_redirect_to_itself(base: str) -> None:
    assert await images.load_image(f"{base}/img", ALLOWED) == BODY
    assert await images.load_image(f"{base}/to-img", ALLOWED) == BODY


async def test_hosts_schemes_and_redirects_off_the_list_are_refused(base: str) -> None:
    assert "no --allowed-media-domains" in await refused(f"{base}/img", ())
    assert "'localhost' is not in --allowed-media-domains" in await refused(f"{base}/to-localhost")
    assert "redirects too often" in await refused(f"{base}/loop")
    assert "HTTP 404" in await refused(f"{base}/missing")
    for url in ("file:///etc/passwd", "ftp://127.0.0.1/x", "gopher://x", "/etc/passwd"):
        assert "refused" in await refused(url)


async def test_the_byte_cap_at_just_under_and_over(base: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(images, "MAX_IMAGE_BYTES", 2048)
    assert len(await images.load_image(f"{base}/big", ALLOWED)) == 2048  # at the cap
    monkeypatch.setattr(images, "MAX_IMAGE_BYTES", 2047)
    assert "larger than 2047 bytes" in await refused(f"{base}/big")


async def test_a_host_that_never_answers_times_out(base: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(images, "FETCH_TIMEOUT", 0.5)
    assert "could not be fetched" in await refused(f"{base}/hang")
