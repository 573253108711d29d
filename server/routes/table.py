"""The one route table. Each entry: a path, its methods, the factory of its endpoint, what it needs (an engine, a
tokenizer only, or the server itself), whether its body names the model, and its family (whose property is the
shape of its errors). Every app is derived from it: the full server (server/app.py create_app), the render-only
server (`spindle render`: what needs an engine answers a 404 naming `spindle serve`) and the --models-dir front
(server/fleet/front.py: each model-named path goes to the app of the model the body names)."""

from __future__ import annotations

import enum
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.routing import Route

from server.app_state import AppState
from server.config import ServerConfig
from server.families import Family
from server.families.anthropic import FAMILY as ANTHROPIC
from server.families.anthropic.messages import CountTokensRoute, MessagesRoute
from server.families.audio import FAMILY as AUDIO
from server.families.audio.transcriptions import AudioRoute
from server.families.batch import FAMILY as BATCH
from server.families.batch.disk import batch_root
from server.families.batch.lines import ENDPOINTS as BATCH_ENDPOINTS
from server.families.batch.routes import BatchesRoute, BatchRoute, FileRoute, FilesRoute
from server.families.batch.runner import BatchRunner
from server.families.cohere import FAMILY as COHERE
from server.families.cohere.embed import CohereEmbedRoute
from server.families.cohere.rerank import CohereRerankRoute
from server.families.llamacpp import FAMILY as LLAMACPP
from server.families.llamacpp.infill import InfillRoute
from server.families.ollama import FAMILY as OLLAMA
from server.families.ollama.embed import EmbeddingsRoute as OllamaEmbeddingsRoute
from server.families.ollama.embed import EmbedRoute as OllamaEmbedRoute
from server.families.ollama.info import OllamaVersionRoute, PsRoute, ShowRoute, TagsRoute
from server.families.ollama.routes import ChatRoute as OllamaChatRoute
from server.families.ollama.routes import GenerateRoute as OllamaGenerateRoute
from server.families.openai import FAMILY as OPENAI
from server.families.openai.chat import ChatRoute
from server.families.openai.completions import CompletionsRoute
from server.families.openai.embeddings import EmbeddingsRoute
from server.families.openai.model_list import ModelsRoute
from server.families.pooling import FAMILY as POOLING
from server.families.pooling.classify import ClassifyRoute
from server.families.pooling.pool import PoolingRoute
from server.families.pooling.rerank import RerankRoute
from server.families.pooling.score import ScoreRoute
from server.families.responses import FAMILY as RESPONSES
from server.families.responses.background import BackgroundResponses
from server.families.responses.routes import ResponsesRoute, StoredResponseRoute
from server.families.responses.store import ResponseStore
from server.families.vllm import FAMILY as VLLM
from server.families.vllm.generate import GenerateRoute
from server.families.vllm.lora import LoadLoRARoute, UnloadLoRARoute
from server.families.vllm.render import ChatRenderRoute, CompletionsRenderRoute
from server.families.vllm.tokenize import DetokenizeRoute, TokenizeRoute
from server.metrics.prometheus import ServerMetrics
from server.multimodal.images import image_support
from server.routes.health import HealthRoute, VersionRoute
from server.routes.metrics_route import MetricsRoute
from server.routes.render_only import NotHereRoute
from server.routes.ui import ASSETS, AssetRoute, PageRoute
from server.worker_context import WorkerContext

log = logging.getLogger("spindle.server")

SERVER = Family("server")  # the server's own routes: health, version, metrics, the model list
PAGE = Family("chat page")  # the chat page and its assets (server/routes/ui.py)


class Needs(enum.Enum):
    ENGINE = "an engine"  # it generates (or is the page that does): `spindle render` answers a 404 for it
    TOKENIZER = "a tokenizer"  # templates and token ids only: `spindle render` serves it too
    SERVER = "the server"  # the server's own state: every app answers it itself


class RouteContext:
    """What the factories build endpoints from: one app's state and metrics, and the objects several routes share."""

    def __init__(
        self,
        state: AppState,
        metrics: ServerMetrics | None = None,
        *,
        worker: WorkerContext | None = None,
        responses_store: ResponseStore | None = None,
        vision: bool | None = None,
    ) -> None:
        self.state, self.metrics, self.worker = state, metrics, worker
        self._store, self._vision = responses_store, vision
        self._made: dict[type, Any] = {}

    def once(self, route: Callable[[AppState], Any]) -> Any:
        """One endpoint of this kind per app, for the paths that share it (/score and /v1/score)."""
        key: Any = route
        if key not in self._made:
            self._made[key] = route(self.state)
        return self._made[key]

    @property
    def server_metrics(self) -> ServerMetrics:
        assert self.metrics is not None, "an app that answers /metrics records its own"
        return self.metrics

    @functools.cached_property
    def store(self) -> ResponseStore:
        # one store for all API processes (a file in the launcher's directory); a single server's in memory
        if self._store is not None:
            return self._store
        shared = self.worker.responses_dir if self.worker is not None else None
        outputs = self.state.config.outputs
        return ResponseStore(outputs.responses_store_size, shared, outputs.responses_store_max_bytes)

    @functools.cached_property
    def background(self) -> BackgroundResponses:
        return BackgroundResponses(self.state, self.store)

    @functools.cached_property
    def batches(self) -> BatchRunner:
        # a batch line takes the online route's endpoint: the same checks, path and answer
        endpoints = {spec.path: spec.make(self) for spec in TABLE if spec.path in BATCH_ENDPOINTS}
        return BatchRunner(self.state, batch_root(self.state.config), endpoints)

    @functools.cached_property
    def page(self) -> PageRoute:
        vision = self._vision
        if vision is None:  # a single model's page offers images when its checkpoint takes them
            model = self.state.config.model.model
            vision = model is not None and image_support(model) is not None
        return PageRoute(self.state, vision=vision)


def _always(config: ServerConfig) -> bool:
    return True


def _runtime_lora(config: ServerConfig) -> bool:
    return config.lora.allow_runtime_lora_updating


def _ui(config: ServerConfig) -> bool:
    return not config.http.disable_ui


@dataclass(frozen=True)
class RouteSpec:
    path: str
    methods: tuple[str, ...]
    make: Callable[[RouteContext], Any]
    needs: Needs
    family: Family
    model_named: bool = True  # the body names its model: the --models-dir front hands it to that model's app
    enabled: Callable[[ServerConfig], bool] = _always

    def route(self, context: RouteContext) -> Route:
        return Route(self.path, self.make(context), methods=list(self.methods))


POST, GET = ("POST",), ("GET",)
E, T, S = Needs.ENGINE, Needs.TOKENIZER, Needs.SERVER


def _generation() -> tuple[RouteSpec, ...]:
    return (
        RouteSpec("/v1/completions", POST, lambda c: CompletionsRoute(c.state), E, OPENAI),
        RouteSpec("/v1/chat/completions", POST, lambda c: ChatRoute(c.state), E, OPENAI),
        RouteSpec("/v1/embeddings", POST, lambda c: EmbeddingsRoute(c.state), E, OPENAI),
        RouteSpec("/v1/audio/transcriptions", POST, lambda c: AudioRoute(c.state, "transcribe"), E, AUDIO),
        RouteSpec("/v1/audio/translations", POST, lambda c: AudioRoute(c.state, "translate"), E, AUDIO),
        # vLLM's pooling family and Cohere's v2 (a --runner pooling server; elsewhere a 400 naming the flag)
        RouteSpec("/classify", POST, lambda c: ClassifyRoute(c.state), E, POOLING),
        RouteSpec("/score", POST, lambda c: c.once(ScoreRoute), E, POOLING),
        RouteSpec("/v1/score", POST, lambda c: c.once(ScoreRoute), E, POOLING),
        RouteSpec("/rerank", POST, lambda c: c.once(RerankRoute), E, POOLING),
        RouteSpec("/v1/rerank", POST, lambda c: c.once(RerankRoute), E, POOLING),
        RouteSpec("/v2/rerank", POST, lambda c: CohereRerankRoute(c.state), E, COHERE),
        RouteSpec("/pooling", POST, lambda c: PoolingRoute(c.state), E, POOLING),
        RouteSpec("/v2/embed", POST, lambda c: CohereEmbedRoute(c.state), E, COHERE),
        RouteSpec("/inference/v1/generate", POST, lambda c: GenerateRoute(c.state), E, VLLM),
        RouteSpec("/v1/messages", POST, lambda c: MessagesRoute(c.state), E, ANTHROPIC),
        RouteSpec("/v1/messages/count_tokens", POST, lambda c: CountTokensRoute(c.state), E, ANTHROPIC),
        RouteSpec("/infill", POST, lambda c: InfillRoute(c.state), E, LLAMACPP),
    )


def _ollama() -> tuple[RouteSpec, ...]:
    """Ollama's API on the same port (server/families/ollama/). Its clients' liveness probe, HEAD /, is the chat
    page's (a GET route answers HEAD too)."""
    return (
        RouteSpec("/api/chat", POST, lambda c: OllamaChatRoute(c.state), E, OLLAMA),
        RouteSpec("/api/generate", POST, lambda c: OllamaGenerateRoute(c.state), E, OLLAMA),
        RouteSpec("/api/embed", POST, lambda c: OllamaEmbedRoute(c.state), E, OLLAMA),
        RouteSpec("/api/embeddings", POST, lambda c: OllamaEmbeddingsRoute(c.state), E, OLLAMA),
        RouteSpec("/api/show", POST, lambda c: ShowRoute(c.state), T, OLLAMA),
        RouteSpec("/api/tags", GET, lambda c: TagsRoute(c.state), S, OLLAMA, False),
        RouteSpec("/api/ps", GET, lambda c: PsRoute(c.state), S, OLLAMA, False),
        RouteSpec("/api/version", GET, lambda c: OllamaVersionRoute(), S, OLLAMA, False),
    )


def _responses() -> tuple[RouteSpec, ...]:
    # a stored response is found by its id, not by a model: the front answers from the store that holds it
    stored = "/v1/responses/{response_id}"
    return (
        RouteSpec("/v1/responses", POST, lambda c: ResponsesRoute(c.state, c.store, c.background), E, RESPONSES),
        RouteSpec(stored, ("GET", "DELETE"), lambda c: StoredResponseRoute(c.store), E, RESPONSES, False),
        RouteSpec(stored + "/cancel", POST, lambda c: StoredResponseRoute(c.store, c.background), E, RESPONSES, False),
    )


def _batch() -> tuple[RouteSpec, ...]:
    """OpenAI's Batch API (server/families/batch/): files and batches are found by id, not by a model."""
    file, batch = "/v1/files/{file_id}", "/v1/batches/{batch_id}"
    return (
        RouteSpec("/v1/files", ("GET", "POST"), lambda c: FilesRoute(c.batches), E, BATCH, False),
        RouteSpec(file, ("GET", "DELETE"), lambda c: FileRoute(c.batches), E, BATCH, False),
        RouteSpec(file + "/content", GET, lambda c: FileRoute(c.batches, content=True), E, BATCH, False),
        RouteSpec("/v1/batches", ("GET", "POST"), lambda c: BatchesRoute(c.batches), E, BATCH, False),
        RouteSpec(batch, GET, lambda c: BatchRoute(c.batches), E, BATCH, False),
        RouteSpec(batch + "/cancel", POST, lambda c: BatchRoute(c.batches, cancel=True), E, BATCH, False),
    )


def _lora() -> tuple[RouteSpec, ...]:
    """vLLM's runtime adapter routes (SPINDLE_ALLOW_RUNTIME_LORA_UPDATING=1 only, as vLLM)."""
    return (
        RouteSpec("/v1/load_lora_adapter", POST, lambda c: LoadLoRARoute(c.state), E, VLLM, True, _runtime_lora),
        RouteSpec("/v1/unload_lora_adapter", POST, lambda c: UnloadLoRARoute(c.state), E, VLLM, True, _runtime_lora),
    )


def _common() -> tuple[RouteSpec, ...]:
    """What `spindle serve` and `spindle render` both answer."""
    return (
        RouteSpec("/v1/models", GET, lambda c: ModelsRoute(c.state), S, OPENAI, False),
        RouteSpec("/health", GET, lambda c: HealthRoute(c.state), S, SERVER, False),
        RouteSpec("/version", GET, lambda c: VersionRoute(), S, SERVER, False),
        RouteSpec("/metrics", GET, lambda c: MetricsRoute(c.server_metrics), S, SERVER, False),
        RouteSpec("/tokenize", POST, lambda c: TokenizeRoute(c.state), T, VLLM),
        RouteSpec("/detokenize", POST, lambda c: DetokenizeRoute(c.state), T, VLLM),
        RouteSpec("/v1/completions/render", POST, lambda c: CompletionsRenderRoute(c.state), T, VLLM),
        RouteSpec("/v1/chat/completions/render", POST, lambda c: ChatRenderRoute(c.state), T, VLLM),
    )


def _page() -> tuple[RouteSpec, ...]:
    """The chat page at / and /ui, and its assets (server/routes/ui.py): it chats, so a full server's only."""
    pages = tuple(RouteSpec(path, GET, lambda c: c.page, E, PAGE, False, _ui) for path in ("/", "/ui"))
    assets = tuple(
        RouteSpec(f"/ui/{name}", GET, functools.partial(_asset, name), E, PAGE, False, _ui) for name in ASSETS
    )
    return pages + assets


def _asset(name: str, context: RouteContext) -> AssetRoute:
    return AssetRoute(name)


TABLE: tuple[RouteSpec, ...] = _generation() + _ollama() + _responses() + _batch() + _lora() + _common() + _page()


def enabled(config: ServerConfig) -> list[RouteSpec]:
    return [spec for spec in TABLE if spec.enabled(config)]


def full_routes(context: RouteContext) -> list[Route]:
    """`spindle serve`: every enabled entry's own endpoint."""
    if _runtime_lora(context.state.config):
        log.warning(
            "runtime LoRA updating is on (SPINDLE_ALLOW_RUNTIME_LORA_UPDATING=1): any client may load adapters "
            "from this machine's files with /v1/load_lora_adapter"
        )
    return [spec.route(context) for spec in enabled(context.state.config)]


def render_only_routes(context: RouteContext) -> list[Route]:
    """`spindle render`: what needs no engine, and a 404 naming `spindle serve` (any method) for what does."""
    not_here = NotHereRoute()
    return [
        Route(spec.path, not_here) if spec.needs is Needs.ENGINE else spec.route(context)
        for spec in enabled(context.state.config)
    ]


def page_routes(context: RouteContext) -> list[Route]:
    """The chat page's routes alone (the --models-dir front serves its own page)."""
    return [spec.route(context) for spec in enabled(context.state.config) if spec.family is PAGE]
