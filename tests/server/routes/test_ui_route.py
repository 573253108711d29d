"""The chat page's routes (server/routes/ui.py) through the real app's middleware: served at / and /ui with its assets,
open without an API key while the API stays closed, under --root-path, off with --disable-ui, absent from
`spindle render`; and the page itself offline (no URL that leaves the server). The browser tests are
tests/e2e/test_ui.py."""

from __future__ import annotations

import re
import tomllib
from importlib.resources import files
from pathlib import Path
from typing import Any

import httpx
import pytest

from demo.tokenizers import tokenizer_dir
from server.app import create_app
from server.cli import config_from_args
from server.config import ServerConfig

pytestmark = pytest.mark.anyio
ASSETS = ("/ui/app.js", "/ui/markdown.js", "/ui/app.css")


def app(**config: Any) -> Any:
    return create_app(ServerConfig.from_settings(model=str(tokenizer_dir("qwen2")), served_model_name="tiny", **config))


async def get(asgi: Any, path: str, method: str = "GET") -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi), base_url="http://spindle.test") as c:
        return await c.request(method, path)


@pytest.mark.parametrize("path", ["/", "/ui"])
async def test_page_at_root_and_ui(path: str) -> None:
    r = await get(app(), path)
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/html; charset=utf-8"
    assert re.search(r"<title>[^<]*spindle[^<]*</title>", r.text)
    csp = r.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp and "script-src 'self'" in csp
    assert 'data-vision="0"' in r.text  # a text model: no image attach
    for testid in (
        "prompt",
        "send",
        "stop",
        "model-select",
        "api-key",
        "temperature",
        "max-tokens",
        "system-prompt",
        "error",
    ):
        assert f'data-testid="{testid}"' in r.text, testid


async def test_head_has_no_body() -> None:
    r = await get(app(), "/", "HEAD")
    assert r.status_code == 200 and r.content == b"" and int(r.headers["content-length"]) > 0


@pytest.mark.parametrize("path", ASSETS)
async def test_assets(path: str) -> None:
    r = await get(app(), path)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/css" if path.endswith(".css") else "text/javascript")
    assert r.headers["x-content-type-options"] == "nosniff"
    assert r.content == files("server").joinpath(path.lstrip("/")).read_bytes()


async def test_unknown_asset_is_404() -> None:
    assert (await get(app(), "/ui/nope.js")).status_code == 404


async def test_page_needs_no_key_but_the_api_does() -> None:
    keyed = app(api_keys=("secret",))
    for path in ("/", "/ui", *ASSETS):
        assert (await get(keyed, path)).status_code == 200, path
    assert (await get(keyed, "/v1/models")).status_code == 401
    assert (await get(keyed, "/ui/nope.js")).status_code == 401  # only the page's own files are open


@pytest.mark.parametrize("path", ["/llm/", "/llm/ui", "/llm/ui/app.js", "/", "/ui/app.css"])
async def test_under_root_path(path: str) -> None:
    assert (await get(app(root_path="/llm"), path)).status_code == 200  # prefix kept by the proxy, or stripped


async def test_disable_ui() -> None:
    off = app(disable_ui=True, api_keys=("secret",))
    for path in ("/", "/ui", *ASSETS):
        assert (await get(off, path)).status_code == 401, path  # not public any more: the key is asked first
    off = app(disable_ui=True)
    for path in ("/", "/ui", *ASSETS):
        assert (await get(off, path)).status_code == 404, path


def test_disable_ui_flag() -> None:
    assert config_from_args(["--disable-ui"]).http.disable_ui is True
    assert config_from_args([]).http.disable_ui is False


async def test_render_only_server_has_no_page() -> None:
    render = app(render_only=True)
    for path in ("/", "/ui", *ASSETS):
        assert (await get(render, path)).status_code == 404, path


def test_page_references_nothing_outside_the_server() -> None:
    """Offline: no absolute URL, no protocol-relative one, no root-absolute path (it would break --root-path)."""
    for name in ("index.html", "app.js", "markdown.js", "app.css"):
        text = files("server").joinpath("ui", name).read_text()
        assert not re.search(r"""(?:src|href)\s*=\s*["'](?:[a-z]+:|/)(?!,)""", text.replace('href="data:,"', "")), name
        assert not re.search(r"""(?:fetch|url)\(\s*["'`](?:https?:|/)""", text), name
        assert "@import" not in text and "cdn" not in text.lower(), name


async def test_vision_model_page_offers_images(qwen2_vl_ckpt: Any) -> None:
    r = await get(create_app(ServerConfig.from_settings(model=str(qwen2_vl_ckpt), served_model_name="vl")), "/")
    assert 'data-vision="1"' in r.text


def test_page_files_are_package_data() -> None:
    """An installed (not editable) server has the page: pyproject ships server/ui/*, and nothing there is missed."""
    pyproject = tomllib.loads((Path(__file__).resolve().parents[3] / "pyproject.toml").read_text())
    assert "ui/*" in pyproject["tool"]["setuptools"]["package-data"]["server"]
    shipped = {p.name for p in files("server").joinpath("ui").iterdir()}
    assert shipped == {"index.html", "app.js", "markdown.js", "app.css"}
