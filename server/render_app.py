"""`spindle render --model M`: the render-only server. Tokenizer, chat templates and the render routes; no engine.

Routes: /tokenize, /detokenize, /v1/completions/render, /v1/chat/completions/render, /v1/models, /health,
/version, /metrics; the same validation, template sandbox (render workers), API keys, CORS and root path as
`spindle serve`. The generation routes answer 404 naming `spindle serve`. For a router that places requests
by prefix (it tokenizes here, hashes the ids, picks a replica): docs/deployment.md.

No torch in this process or its render workers: the model's limits come from config.json and
generation_config.json as the engine reads them (engine/models/loader.py, engine/model_runner.py), read here
without importing the engine's model code. tests/e2e/test_render_only.py checks /proc/PID/maps for libtorch.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
from starlette.routing import Route, Router

from server.api.health import VersionRoute
from server.api.metrics import MetricsRoute
from server.api.openai.models import ModelsRoute
from server.api.state import AppState
from server.api.vllm.render import ChatRenderRoute, CompletionsRenderRoute
from server.api.vllm.tokenize import DetokenizeRoute, TokenizeRoute
from server.config import ServerConfig
from server.deploy import wrap_app
from server.http.asgi import Receive, Scope, Send, send_error, send_json
from server.http.errors import APIError, describe_exception
from server.metrics import ServerMetrics
from server.pipeline.input_processor import ModelLimits

log = logging.getLogger("spindle.server")

# generation_config.json keys that become default sampling parameters: engine/models/loader.py _SAMPLING_KEYS
_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                  "presence_penalty", "frequency_penalty", "max_new_tokens")
GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/messages",
                     "/v1/messages/count_tokens", "/inference/v1/generate")


def render_config(config: ServerConfig) -> ServerConfig:
    """The config `spindle render` runs with; ValueError (exit 2) for what a render-only server cannot do."""
    if config.model is None:
        raise ValueError("spindle render needs --model (a local checkpoint folder with the tokenizer)")
    if config.headless:
        raise ValueError("spindle render runs no engine ranks: --headless does not apply")
    return dataclasses.replace(config, render_only=True)


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} should hold a JSON object")
    return data


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def checkpoint_limits(config: ServerConfig, tokenizer: Any) -> ModelLimits:
    """The ModelLimits the full server builds from the engine's Ready, read from the checkpoint's files."""
    from engine.messages import Ready

    from server.app import limits_for

    folder = Path(config.model_path)
    if not (folder / "config.json").is_file():
        raise ValueError(f"{folder} has no config.json; pass a Hugging Face format checkpoint folder")
    cfg = _json(folder / "config.json")
    max_pos = int(cfg.get("max_position_embeddings", 4096))
    if config.max_model_len is not None and config.max_model_len > max_pos:
        raise ValueError(f"--max-model-len {config.max_model_len} exceeds the model's max_position_embeddings "
                         f"{max_pos}; pass at most {max_pos}")
    gen_file = folder / "generation_config.json"
    gen = _json(gen_file) if gen_file.is_file() else {}
    eos = _ids(gen.get("eos_token_id")) or _ids(cfg.get("eos_token_id"))
    defaults = {k: gen[k] for k in _SAMPLING_KEYS if isinstance(gen.get(k), (int, float))}
    vocab = cfg.get("vocab_size", (cfg.get("text_config") or {}).get("vocab_size"))  # VL configs may nest it
    if vocab is None:
        raise ValueError(f"{folder / 'config.json'} has no vocab_size")
    ready = Ready(max_model_len=config.max_model_len or max_pos, vocab_size=int(vocab),
                  eos_token_ids=eos, num_blocks=0, block_size=config.block_size, model_dtype="none",
                  generation_defaults=defaults)
    return limits_for(config, ready, tokenizer)


class RenderHealthRoute:
    """200 once the tokenizer, templates and workers are up; 503 while loading and while stopping."""

    def __init__(self, state: AppState) -> None:
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            self.state.require_renderer()
        except APIError as e:
            await send_json(send, 503, e.body())
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})


class NotHereRoute:
    """A generation route on the render-only server: 404 saying where it is served."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_error(send, APIError(
            f"{scope['path']} is not served here: this is a render-only server (`spindle render`), which "
            "tokenizes and renders prompts but runs no model; send generation requests to a `spindle serve` "
            "server.", status=404))


async def _not_found(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http":
        return
    await send_error(send, APIError(
        f"No route {scope.get('method')} {scope['path']} on this render-only server; see /tokenize, /detokenize, "
        "/v1/completions/render, /v1/chat/completions/render, /v1/models.", status=404))


def create_render_app(config: ServerConfig, *, on_fatal: Callable[[str], None] | None = None,
                      renderer_factory: Any = None, load_in_background: bool = False) -> Any:
    """The render-only ASGI app (create_app sends a config with render_only here)."""
    from server.app import _default_on_fatal, _open_renderer, open_image_worker_for

    state = AppState(config=config, model_name=config.model_name)
    metrics = ServerMetrics(config.model_name)
    if config.metrics_compat == "vllm":
        from server.metrics_compat import export_vllm_names

        export_vllm_names(metrics)
    open_renderer = renderer_factory or _open_renderer
    fatal = on_fatal or _default_on_fatal

    async def run_renderer(*, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with open_renderer(config) as renderer, open_image_worker_for(config) as mm_pool:
            limits = await anyio.to_thread.run_sync(checkpoint_limits, config, getattr(renderer, "tokenizer", None))
            state.renderer, state.limits, state.mm_pool = renderer, limits, mm_pool
            log.info("rendering for %s (max_model_len %d); no engine", state.model_name, limits.max_model_len)
            task_status.started()
            await anyio.sleep_forever()

    async def load_or_die() -> None:
        try:
            await run_renderer()
        except Exception as e:
            log.error("startup failed: %s", describe_exception(e))
            fatal(f"startup failed: {describe_exception(e)}")

    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        async with anyio.create_task_group() as tg:
            if load_in_background:
                tg.start_soon(load_or_die)
            else:
                await tg.start(run_renderer)
            try:
                yield
            finally:
                state.stopping = True
                tg.cancel_scope.cancel()

    not_here = NotHereRoute()
    routes = [
        Route("/tokenize", TokenizeRoute(state), methods=["POST"]),
        Route("/detokenize", DetokenizeRoute(state), methods=["POST"]),
        Route("/v1/completions/render", CompletionsRenderRoute(state), methods=["POST"]),
        Route("/v1/chat/completions/render", ChatRenderRoute(state), methods=["POST"]),
        Route("/v1/models", ModelsRoute(state), methods=["GET"]),
        Route("/health", RenderHealthRoute(state), methods=["GET"]),
        Route("/version", VersionRoute(), methods=["GET"]),
        Route("/metrics", MetricsRoute(metrics), methods=["GET"]),
        *(Route(path, not_here) for path in GENERATION_ROUTES),
    ]
    router = Router(routes=routes, lifespan=lifespan, default=_not_found)
    app: Any = wrap_app(router, config)
    app.state_holder = state
    return app
