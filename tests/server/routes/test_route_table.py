"""The one route table (server/routes/table.py) and the three apps derived from it agree: the full server serves
every enabled entry, the render-only server answers each entry that needs an engine with its 404 naming
`spindle serve` and serves the rest, and the --models-dir front routes exactly the table's model-named paths, each
refusal in its family's error shape (Anthropic's for Anthropic's paths)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.routing import Route

from demo.tokenizers import tokenizer_dir
from server.app import create_app
from server.config import ServerConfig
from server.families import ErrorShape
from server.fleet.front import create_models_app
from server.routes.table import TABLE, Needs, RouteSpec, enabled

pytestmark = pytest.mark.anyio
SETTINGS: dict[str, Any] = {"enable_lora": True, "allow_runtime_lora_updating": True}


def _config(**settings: Any) -> ServerConfig:
    return ServerConfig.from_settings(
        model=str(tokenizer_dir("qwen2")), served_model_name="tiny", **{**SETTINGS, **settings}
    )


def _paths(app: Any) -> dict[str, set[str]]:
    """path -> methods of the routes the app's router holds (an empty set: any method)."""
    router = app.app if hasattr(app, "app") else app
    while not hasattr(router, "routes"):
        router = router.app
    return {r.path: set(r.methods or ()) - {"HEAD"} for r in router.routes if isinstance(r, Route)}


async def _call(app: Any, method: str, path: str, body: bytes = b"{}") -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://spindle.test") as c:
        return await c.request(method, path, content=body, headers={"content-type": "application/json"})


def test_every_path_is_listed_once_with_a_family() -> None:
    keys = [(spec.path, spec.methods) for spec in TABLE]
    assert len(keys) == len(set(keys))
    assert all(spec.family.name for spec in TABLE)
    assert {spec.family.errors for spec in TABLE if spec.path.startswith("/v1/messages")} == {ErrorShape.ANTHROPIC}
    assert {spec.family.errors for spec in TABLE if spec.path.startswith("/api/")} == {ErrorShape.OLLAMA}
    rest = {spec.family.errors for spec in TABLE if not spec.path.startswith(("/v1/messages", "/api/"))}
    assert rest == {ErrorShape.OPENAI}


def test_the_full_app_serves_the_enabled_table() -> None:
    config = _config()
    full = _paths(create_app(config))
    assert full == {spec.path: set(spec.methods) for spec in enabled(config)}
    off = _config(disable_ui=True, allow_runtime_lora_updating=False)
    assert set(_paths(create_app(off))) == {spec.path for spec in enabled(off)}
    assert "/v1/load_lora_adapter" not in _paths(create_app(off)) and "/" not in _paths(create_app(off))


async def test_every_engine_path_of_the_full_app_answers_the_render_only_404() -> None:
    config = _config()
    render = create_app(_config(render_only=True))
    render_paths = _paths(render)
    full = _paths(create_app(config))
    engine_specs = [spec for spec in enabled(config) if spec.needs is Needs.ENGINE]
    assert engine_specs and {spec.path for spec in engine_specs} <= set(full)
    for spec in engine_specs:
        assert render_paths[spec.path] == set()  # any method: the same 404
        path = spec.path.replace("{response_id}", "resp_1")
        r = await _call(render, spec.methods[0], path)
        assert r.status_code == 404 and "spindle serve" in r.json()["error"]["message"], path
    served = {spec.path for spec in enabled(config) if spec.needs is not Needs.ENGINE}
    assert {path for path, methods in render_paths.items() if methods} == served


def _front(tmp_path: Path, **settings: Any) -> Any:
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    return create_models_app(ServerConfig.from_settings(models_dir=str(tmp_path), **{**SETTINGS, **settings}))


def _model_named(spec: RouteSpec) -> bool:
    return spec.model_named


async def test_the_front_routes_exactly_the_model_named_paths(tmp_path: Path) -> None:
    front = _front(tmp_path)
    config = front.state_holder.config
    routed = _paths(front)
    named = {spec.path: set(spec.methods) for spec in enabled(config) if _model_named(spec)}
    own = {spec.path for spec in enabled(config) if not _model_named(spec)}
    assert {path: routed[path] for path in named} == named
    assert set(routed) == set(named) | own  # the rest the front answers itself (models, health, the stored ...)
    r = await _call(front, "POST", "/v1/no_such_route", b'{"model": "a"}')
    assert r.status_code == 404 and r.json()["error"]["message"].startswith("No route POST /v1/no_such_route")


async def test_the_front_refuses_in_the_family_shape(tmp_path: Path) -> None:
    front = _front(tmp_path)
    for spec in enabled(front.state_holder.config):
        if not spec.model_named:
            continue
        unknown = await _call(front, spec.methods[0], spec.path, b'{"model": "nope"}')
        not_json = await _call(front, spec.methods[0], spec.path, b"[")
        assert (unknown.status_code, not_json.status_code) == (404, 400), spec.path
        for r in (unknown, not_json):
            if spec.family.errors is ErrorShape.ANTHROPIC:
                assert r.json()["type"] == "error" and "message" in r.json()["error"], spec.path
            elif spec.family.errors is ErrorShape.OLLAMA:
                assert set(r.json()) == {"error"} and isinstance(r.json()["error"], str), spec.path
            else:
                assert "message" in r.json()["error"] and "type" not in r.json(), spec.path
        if spec.family.errors is ErrorShape.OPENAI:
            assert unknown.json()["error"]["code"] == "model_not_found"


async def test_the_front_lists_every_model_for_ollama(tmp_path: Path) -> None:
    """/api/tags lists the --models-dir catalog (loaded or not); /api/ps the loaded ones (none yet)."""
    front = _front(tmp_path)
    tags = await _call(front, "GET", "/api/tags")
    assert [m["name"] for m in tags.json()["models"]] == ["a", "b"]
    assert (await _call(front, "GET", "/api/ps")).json() == {"models": []}
    assert (await _call(front, "GET", "/api/version")).json()["version"]
