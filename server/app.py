"""create_app(config): the raw-ASGI Starlette app; its lifespan runs the renderer, the engine and AsyncLLM.

`hypercorn 'server.app:create_app()' -k trio` works too: with no config, SPINDLE_* env vars are read. The
process's role comes in as an argument: `worker` is an --api-server-count API process's WorkerContext
(server/worker_context.py), whose engine channels, admission and metrics are shared with the other API
processes; None (a single server, or plain Hypercorn) opens its own engine.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import anyio
from hypercorn.config import Config as HypercornConfig
from starlette.routing import Route, Router

from server.app_load import (
    EngineFactory,
    EngineLoad,
    RendererFactory,
    open_image_worker_for,
    open_model_renderer,
    server_metrics,
)
from server.app_state import AppState
from server.config import ServerConfig
from server.families.responses.store import ResponseStore
from server.http.asgi import no_route
from server.http.deploy import wrap_app
from server.http.errors import describe_exception
from server.metrics.prometheus import ServerMetrics
from server.multimodal.images import image_support
from server.render_app import checkpoint_limits
from server.routes.render_only import not_found as render_not_found
from server.routes.table import RouteContext, full_routes, page_routes, render_only_routes
from server.routes.ui import PUBLIC_PATHS
from server.worker_context import WorkerContext

log = logging.getLogger("spindle.server")


def _default_on_fatal(why: str) -> None:
    # Served by an outside Hypercorn: ask it to shut down the way Ctrl-C would.
    os.kill(os.getpid(), signal.SIGTERM)


not_found = no_route("; see /v1/models, /v1/completions, /v1/chat/completions.")


def _refuse_several_hypercorn_workers() -> None:
    """Exit if a Hypercorn worker with `-w N`, N > 1, is loading the app: each worker would start an engine.

    Hypercorn runs `load_application` (which calls create_app()) from its worker function, whose
    `config` local is the Hypercorn Config; found on the stack, its `workers` says how many run.
    """
    frame: Any = sys._getframe(1)
    for _ in range(32):  # a few frames up: Hypercorn's worker function calls load_application, which calls us
        if frame is None:
            return
        found = frame.f_locals.get("config")
        if isinstance(found, HypercornConfig) and isinstance(found.workers, int) and found.workers > 1:
            raise SystemExit(
                f"spindle: Hypercorn runs {found.workers} workers, and each would start its own "
                f"engine; for several API-server processes in front of one engine run "
                f"`python -m server --api-server-count {found.workers}` (or one worker, -w 1)."
            )
        frame = frame.f_back


def create_app(
    config: ServerConfig | None = None,
    *,
    worker: WorkerContext | None = None,
    on_fatal: Callable[[str], None] | None = None,
    engine_factory: EngineFactory | None = None,
    renderer_factory: RendererFactory | None = None,
    load_in_background: bool = False,
    wrap: bool = True,
    responses_store: ResponseStore | None = None,
) -> Any:
    """The ASGI app. `on_fatal(why)` is called once if the engine dies (the CLI exits non-zero).

    worker: this process's place under the --api-server-count launcher (None: a single server).
    load_in_background: the lifespan returns at once and the model loads behind it (the CLI does this,
    so /health answers 503 while loading); otherwise startup waits for the engine, and a failed load
    fails startup.
    wrap: False gives the bare router (one model behind --models-dir, whose front app does auth and logging).
    responses_store: the Responses store to use (--models-dir keeps each model's across its loads).
    """
    if config is None:  # plain `hypercorn 'server.app:create_app()'`: one engine per worker process
        _refuse_several_hypercorn_workers()
        # SPINDLE_RENDER_ONLY=1 is checked there as `spindle render` is; no SPINDLE_MODEL: the default model
        config = ServerConfig.from_env(default_model=True)
    state = AppState(config=config, model_name=config.model.model_name)
    metrics = server_metrics(config, worker)
    fatal = on_fatal or _default_on_fatal
    open_renderer = renderer_factory or open_model_renderer
    if config.parallel.render_only:  # `spindle render`: no engine, no torch (server/render_app.py)
        return _render_only_app(state, metrics, open_renderer, fatal, load_in_background)
    metrics.watch_engine()
    load = EngineLoad(state, metrics, worker, engine_factory, open_renderer, fatal)
    routes = full_routes(RouteContext(state, metrics, worker=worker, responses_store=responses_store))
    public = () if config.http.disable_ui else PUBLIC_PATHS
    return _asgi(state, routes, _lifespan(state, load.run, fatal, load_in_background), not_found, public, wrap)


def front_page_routes(config: ServerConfig, models: list[str]) -> tuple[list[Route], tuple[str, ...]]:
    """--models-dir: the chat page's routes (its picker lists every model from the front's /v1/models; the image
    button where any model in `models`, checkpoint paths, takes images) and the paths open without an API key."""
    if config.http.disable_ui:
        return [], ()
    vision = any(image_support(path) is not None for path in models)
    return page_routes(RouteContext(AppState(config=config, model_name=""), vision=vision)), PUBLIC_PATHS


def _asgi(
    state: AppState, routes: list[Route], lifespan: Any, not_found: Any, public: tuple[str, ...] = (), wrap: bool = True
) -> Any:
    app: Any = Router(routes=routes, lifespan=lifespan, default=not_found)
    if wrap:  # access log, CORS, API key, root path (server/http/deploy.py)
        app = wrap_app(app, state.config, public)
    app.state_holder = state  # for tests and diagnostics
    return app


def _lifespan(
    state: AppState, run: Callable[..., Any], fatal: Callable[[str], None], load_in_background: bool
) -> Callable[[Any], AbstractAsyncContextManager[None]]:
    """Start `run` (it calls task_status.started() once serving) and cancel it at shutdown.

    load_in_background: the listener comes up at once; /health says 503 until `run` is ready, and a failed
    load calls `fatal` (the CLI exits non-zero). Otherwise startup waits for it, and a failed load fails it.
    """

    async def load_or_die() -> None:
        try:
            await run()
        except Exception as e:  # the model did not load: say why; the CLI exits non-zero
            log.error("startup failed: %s", describe_exception(e))
            fatal(f"startup failed: {describe_exception(e)}")

    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        async with anyio.create_task_group() as tg:
            if load_in_background:
                tg.start_soon(load_or_die)
            else:
                await tg.start(run)
            try:
                yield
            finally:
                state.stopping.set()
                tg.cancel_scope.cancel()

    return lifespan


def _render_only_app(
    state: AppState,
    metrics: ServerMetrics,
    open_renderer: RendererFactory,
    fatal: Callable[[str], None],
    load_in_background: bool,
) -> Any:
    """`spindle render`: the renderer and the routes that need no engine; generation routes are 404s."""
    config = state.config

    async def run_renderer(*, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with open_renderer(config) as renderer, open_image_worker_for(config) as mm_pool:
            limits = await anyio.to_thread.run_sync(checkpoint_limits, config, getattr(renderer, "tokenizer", None))
            state.renderer, state.limits, state.mm_pool = renderer, limits, mm_pool
            log.info("rendering for %s (max_model_len %d); no engine", state.model_name, limits.max_model_len)
            state.mark_ready()
            task_status.started()
            await anyio.sleep_forever()

    routes = render_only_routes(RouteContext(state, metrics))
    return _asgi(state, routes, _lifespan(state, run_renderer, fatal, load_in_background), render_not_found)
