"""`--models-dir`: the app in front of every model. It answers /v1/models (every model in the folder, loaded or not),
/health, /version and /metrics (each loaded model's, labelled by model_name, and the registry's), and hands each
of the route table's model-named paths (server/routes/table.py) to the app of the model its body names
(server/fleet/routing.py), loaded first if need be
(server/fleet/loaded_set.py). Each model's app is the single-model app (server/app.py create_app, unwrapped):
its own AsyncLLM, engine, renderer, admission, Responses store and metrics.

A streamed request whose model is not loaded gets its SSE headers at once and keep-alive comments while the model
loads; the model's own response then continues that stream (its status line and headers are already sent, so an
error from it becomes one SSE `data:` event with the error body).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import msgspec
from prometheus_client import CollectorRegistry, generate_latest
from starlette.routing import Route, Router

from server.app import create_app, front_page_routes, not_found
from server.app_load import EngineFactory
from server.config import ServerConfig
from server.families import ErrorShape, Family
from server.families.batch import FAMILY as BATCH
from server.families.ollama.keep_alive import KEEPS_LOADED, keep_alive_seconds
from server.families.responses import FAMILY as RESPONSES
from server.fleet.catalog import scan
from server.fleet.follower import FollowerRegistry
from server.fleet.loaded_set import Loaded, ModelRegistry, ModelSlot, RegistryMetrics
from server.fleet.model_metrics import PerModelMetrics
from server.fleet.ollama_front import ollama_routes
from server.fleet.owner import ModelOwner
from server.fleet.routing import keep_alive_of, replay, routing_of
from server.fleet.stored import ModelStores, unknown
from server.http import unavailable
from server.http.asgi import (
    ClientGone,
    Message,
    Receive,
    Scope,
    Send,
    read_body,
    run_until_disconnect,
    send_error,
    send_json,
)
from server.http.deploy import wrap_app
from server.http.errors import APIError
from server.http.version import send_version
from server.metrics.prometheus import CONTENT_TYPE
from server.request.openai_protocol import ModelCardBase
from server.routes.table import enabled
from server.worker_context import WorkerContext

log = logging.getLogger("spindle.server")
KEEPALIVE = b": loading model\n\n"


class ModelCard(ModelCardBase):
    loaded: bool
    object: str = "model"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


_encoder = msgspec.json.Encoder()


def model_not_found(errors: ErrorShape, name: str | None, served: list[str]) -> bytes:
    """OpenAI's 404 for an unknown model (code `model_not_found`); Anthropic's `not_found_error` on its routes."""
    message = (
        f"The model `{name}` does not exist; this server serves: {', '.join(served)}."
        if name is not None
        else f"The request names no `model`; this server serves: {', '.join(served)}."
    )
    if errors is not ErrorShape.OPENAI:
        return errors.body(APIError(message, status=404))
    return _encoder.encode(
        {"error": {"message": message, "type": "invalid_request_error", "param": "model", "code": "model_not_found"}}
    )


class _Endpoint:
    """A method as an ASGI endpoint (Starlette would call a bare method with a Request)."""

    def __init__(self, handle: Callable[[Scope, Receive, Send], Any]) -> None:
        self.handle = handle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.handle(scope, receive, send)


class _ByModel:
    """A model-named path of the route table: to the model's app, errors in the shape of the path's family."""

    def __init__(self, front: ModelsFront, family: Family) -> None:
        self.front, self.errors = front, family.errors

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.front.dispatch(scope, receive, send, self.errors)


def _metrics_of(app: Any) -> Any:
    """The ServerMetrics a model's app records into (its /metrics route's)."""
    return next((route.endpoint.metrics for route in app.routes if getattr(route, "path", None) == "/metrics"), None)


class ModelsFront:
    def __init__(
        self, config: ServerConfig, engine_factory: EngineFactory | None = None, worker: WorkerContext | None = None
    ) -> None:
        assert config.models.models_dir is not None
        self.config = config
        self.prometheus = CollectorRegistry()
        self.engine_factory = engine_factory
        found = scan(config.models.models_dir)
        metrics = RegistryMetrics(self.prometheus)
        self.owner: ModelOwner | None = None
        if worker is not None and worker.models_fd is not None:  # one of --api-server-count's processes
            self.registry: ModelRegistry = FollowerRegistry(config, found, self._make_app, metrics, worker.models_fd)
            if worker.models_owner_fds:  # process 0: the owner of the loaded set (server/fleet/owner.py)
                self.owner = ModelOwner(config, found, worker.models_owner_fds)
        else:
            self.registry = ModelRegistry(config, found, self._make_app, metrics)
        self.per_model = PerModelMetrics(self.registry.slots)
        self.prometheus.register(self.per_model)
        self.registry.on_gone = self.per_model.keep
        entries = {name: slot.entry for name, slot in self.registry.slots.items()}
        shared = worker.responses_dir if worker is not None else None  # the launcher's folder: one file per model
        outputs = config.outputs
        self.stores = ModelStores(entries, outputs.responses_store_size, shared, outputs.responses_store_max_bytes)
        self.created = int(time.time())
        self.limit = max(config.http.max_request_body, int(config.media.max_audio_filesize_mb * 1e6) + (1 << 20))

    @property
    def llm(self) -> ModelRegistry:
        """What SIGTERM drains (server/runtime/http_server.py): every loaded model's requests."""
        return self.registry

    def _make_app(
        self, config: ServerConfig, on_fatal: Callable[[str], None], engine_factory: EngineFactory | None
    ) -> Loaded:
        store = self.stores.stores[config.model.model_name]
        engine = engine_factory or self.engine_factory
        app = create_app(config, on_fatal=on_fatal, engine_factory=engine, wrap=False, responses_store=store)
        return Loaded(app, app.state_holder, _metrics_of(app))

    async def dispatch(self, scope: Scope, receive: Receive, send: Send, errors: ErrorShape) -> None:
        """A model-named route: to the app of the model the body names."""
        if scope["type"] != "http":
            return
        try:
            body = await read_body(receive, self.limit)
            name, stream = routing_of(scope, body)
        except ClientGone:
            return
        except APIError as e:
            await errors.send(send, e)
            return
        slot = self.registry.slots.get(name) if name is not None else None
        if slot is None:
            await send_json(send, 404, model_not_found(errors, name, sorted(self.registry.slots)))
            return
        if errors is ErrorShape.OLLAMA:  # NDJSON has no keep-alive line: the stream starts once the model is loaded
            stream = False
        await self._forward(slot, scope, body, receive, send, stream, errors)
        if scope["path"] in KEEPS_LOADED:  # its keep_alive: how long the model stays loaded now (a bad one: a 400)
            with contextlib.suppress(APIError):
                self.registry.keep(slot, keep_alive_seconds(keep_alive_of(body)))

    async def stored(self, scope: Scope, receive: Receive, send: Send) -> None:
        """GET / DELETE /v1/responses/{id} (from the store that holds it) and POST .../cancel (to its model)."""
        response_id = scope["path_params"]["response_id"]
        try:
            name = await self.stores.owner(response_id)
        except APIError as e:
            await send_error(send, e)
            return
        if name is None:
            await send_error(send, unknown(response_id))
        elif scope["path"].endswith("/cancel"):
            await self._forward(self.registry.slots[name], scope, b"", receive, send, False, RESPONSES.errors)
        else:
            await self.stores.answer(name, scope, receive, send)

    async def _forward(
        self, slot: ModelSlot, scope: Scope, body: bytes, receive: Receive, send: Send, stream: bool, errors: ErrorShape
    ) -> None:
        """To the model's app, once loaded."""
        if slot.status != "loaded" and stream:
            await self._stream_after_load(slot, scope, body, receive, send, errors)
            return
        app, error = await self._acquire(slot, receive)
        if error is not None:
            await errors.send(send, error)
        if app is None:
            return
        try:
            await app(scope, replay(body, receive), send)
        finally:
            self.registry.release(slot)

    async def _acquire(self, slot: ModelSlot, receive: Receive) -> tuple[Any, APIError | None]:
        """(the model's app, None) once loaded; (None, why) when it fails to load; (None, None) when the client
        left while it loaded: it stops waiting (the load goes on, and the model stays loaded, idle)."""
        app: Any = None
        error: APIError | None = None

        async def wait() -> None:
            nonlocal app, error
            try:
                app = await self.registry.acquire(slot)
            except APIError as e:  # raised here, it would reach the caller inside an exception group
                error = e

        if slot.status == "loaded":  # the common path: no task group, no watcher
            await wait()
        elif not await run_until_disconnect(receive, wait):
            if app is not None:  # loaded as the client left
                self.registry.release(slot)
            return None, None
        return app, error

    async def _stream_after_load(
        self, slot: ModelSlot, scope: Scope, body: bytes, receive: Receive, send: Send, errors: ErrorShape
    ) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")],
            }
        )
        done = anyio.Event()
        interval = self.config.outputs.sse_keepalive

        async def keep_alive() -> None:
            while not done.is_set():
                await send({"type": "http.response.body", "body": KEEPALIVE, "more_body": True})
                if not interval:
                    return
                with anyio.move_on_after(interval):
                    await done.wait()

        async with anyio.create_task_group() as tg:
            tg.start_soon(keep_alive)
            try:
                app, error = await self._acquire(slot, receive)
            finally:
                done.set()
        if error is not None:
            event = errors.sse_error_prefix + errors.body(error) + b"\n\n"
            await send({"type": "http.response.body", "body": event})
        if app is None:
            return
        try:
            await app(scope, replay(body, receive), _continue_stream(send, errors.sse_error_prefix))
        finally:
            self.registry.release(slot)

    async def models(self, scope: Scope, receive: Receive, send: Send) -> None:
        registry = self.registry
        if isinstance(registry, FollowerRegistry):  # the owner's answer: the same in every API process
            names = await registry.loaded_names()
        else:
            names = {name for name, slot in registry.slots.items() if slot.status == "loaded"}
        cards = []
        for name, slot in sorted(self.registry.slots.items()):
            limits = slot.loaded.state.limits if slot.loaded is not None else None
            max_len = limits.max_model_len if limits is not None else int(slot.entry.settings.get("max_model_len", 0))
            cards.append(
                ModelCard(
                    id=name,
                    created=self.created,
                    owned_by="spindle",
                    root=str(slot.entry.path),
                    max_model_len=max_len,
                    loaded=name in names,
                )
            )
        await send_json(send, 200, _encoder.encode(ModelList(cards)))

    async def health(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.registry.stopping:
            await send_error(send, unavailable.shutting_down())
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})

    async def metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = generate_latest(self.prometheus)
        headers = [(b"content-type", CONTENT_TYPE.encode()), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    @asynccontextmanager
    async def lifespan(self, app: Any) -> AsyncIterator[None]:
        async with anyio.create_task_group() as owning:
            if self.owner is not None:
                await owning.start(self.owner.run)
            async with anyio.create_task_group() as tg:
                await tg.start(self.registry.run)
                log.info(
                    "serving %d models from %s (up to %d loaded at once)",
                    len(self.registry.slots),
                    self.config.models.models_dir,
                    self.registry.max_loaded,
                )
                try:
                    yield
                finally:
                    self.registry.stopping = True
                    tg.cancel_scope.cancel()
            if self.owner is not None:  # this process's models are closed: the engines go once the others exited
                with anyio.CancelScope(shield=True):
                    await self.owner.shutdown()
            owning.cancel_scope.cancel()


def _continue_stream(send: Send, prefix: bytes) -> Send:
    """The model's own response after the front sent the SSE headers: its start is dropped; a non-200 answer's
    body (an error) is sent as one SSE event."""
    status = 200

    async def forward(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = int(message["status"])
            return
        if message["type"] == "http.response.body" and status != 200:
            message = {
                "type": "http.response.body",
                "body": prefix + bytes(message.get("body", b"")) + b"\n\n",
                "more_body": message.get("more_body", False),
            }
        await send(message)

    return forward


async def _no_batches(scope: Scope, receive: Receive, send: Send) -> None:
    message = "The Batch API (/v1/files, /v1/batches) is served by a single-model server (--model), not --models-dir."
    await send_error(send, APIError(message, status=404))


def create_models_app(
    config: ServerConfig, *, engine_factory: EngineFactory | None = None, worker: WorkerContext | None = None, **_: Any
) -> Any:
    """The --models-dir app (create_app's keyword arguments are accepted; a model's engine death unloads that model
    instead of stopping the server). worker: this process's place under --api-server-count (server/fleet/owner.py)."""
    front = ModelsFront(config, engine_factory, worker)
    routes = [
        Route("/v1/models", _Endpoint(front.models), methods=["GET"]),
        Route("/health", _Endpoint(front.health), methods=["GET"]),
        Route("/version", _Endpoint(send_version), methods=["GET"]),
        Route("/metrics", _Endpoint(front.metrics), methods=["GET"]),
        Route("/v1/responses/{response_id}", _Endpoint(front.stored), methods=["GET", "DELETE"]),
        Route("/v1/responses/{response_id}/cancel", _Endpoint(front.stored), methods=["POST"]),
        *ollama_routes(front.registry),
        *(
            Route(spec.path, _no_batches, methods=list(spec.methods))
            for spec in enabled(config)
            if spec.family is BATCH
        ),
    ]
    by_model = [
        Route(spec.path, _ByModel(front, spec.family), methods=list(spec.methods))
        for spec in enabled(config)
        if spec.model_named
    ]
    page, public = front_page_routes(config, [str(slot.entry.path) for slot in front.registry.slots.values()])
    router = Router(routes=[*routes, *by_model, *page], lifespan=front.lifespan, default=not_found)
    app: Any = wrap_app(router, config, public)
    app.state_holder = front
    return app
