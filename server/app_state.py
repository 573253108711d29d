"""What the routes share: filled in by the app's lifespan once the engine and renderer are up."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import msgspec

from server.config import ServerConfig
from server.http import unavailable
from server.http.errors import APIError, from_decode_error
from server.multimodal.images import ImagePool
from server.render.renderer import Renderer  # the concrete class, so the routes' calls lead to it
from server.request.async_llm import AsyncLLM, Stopping
from server.request.input_processor import ModelLimits
from server.request.openai_protocol import decode_request


class _NamesModel(Protocol):
    @property
    def model(self) -> str | None: ...


Req = TypeVar("Req", bound=_NamesModel)
Body = TypeVar("Body")


def decode_body(
    decoder: msgspec.json.Decoder[Body],
    body: bytes,
    on_decode_error: Callable[[msgspec.DecodeError], APIError] = from_decode_error,
) -> Body:
    """A request body decoded; malformed: a 400 worded by `on_decode_error`."""
    try:
        return decode_request(decoder, body)
    except msgspec.DecodeError as e:
        raise on_decode_error(e) from None


@dataclass
class AppState:
    config: ServerConfig
    model_name: str
    llm: AsyncLLM | None = None
    renderer: Renderer | None = None
    mm_pool: ImagePool | None = None  # a vision model: the image worker (server/multimodal/images.py)
    limits: ModelLimits | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    stopping: Stopping = field(default_factory=Stopping)  # the one draining flag; AsyncLLM is given it
    tasks: Any = None  # an anyio TaskGroup for work that outlives its request (background responses)
    stage: str = "starting"  # what start-up is doing now: /health's 503 says it (server/app_load.py sets it)
    on_ready: list[Callable[[], None]] = field(default_factory=list)  # run once the model serves
    load_started_ns: int = field(default_factory=time.monotonic_ns)
    load_ns: int = 0  # how long the model took to load, until the first generation after it reports it
    keep_until: float | None = None  # Ollama's keep_alive: the wall-clock time a client asked it to stay until

    def mark_ready(self) -> None:
        """Start-up is over: the model serves (the hooks: e.g. the "Running on" line, server/runtime/)."""
        self.stage = "ready"
        self.load_ns = time.monotonic_ns() - self.load_started_ns
        for hook in self.on_ready:
            hook()

    def take_load_ns(self) -> int:
        """The model's load time, once: Ollama reports it with the first request after a load, 0 after that."""
        load, self.load_ns = self.load_ns, 0
        return load

    def require(self, *, count: bool = True) -> tuple[AsyncLLM, Renderer, ModelLimits]:
        """The running parts, or a 503 saying why requests cannot be served now (AsyncLLM.check_open: a
        refusal while draining is counted unless `count` is False)."""
        llm, renderer, limits = self.llm, self.renderer, self.limits
        if llm is None or renderer is None or limits is None:
            raise unavailable.starting(self.stage)
        llm.check_open(count=count)
        return llm, renderer, limits

    def require_renderer(self, *, count: bool = True) -> tuple[Renderer, ModelLimits]:
        """The renderer and limits (503 until they are up); a full server also needs its engine running, as
        for any request, while a render-only one (server/render_app.py) has no engine."""
        if not self.config.parallel.render_only:
            _llm, renderer, limits = self.require(count=count)
            return renderer, limits
        if self.renderer is None or self.limits is None:
            raise unavailable.starting(self.stage)
        if self.stopping.is_set():
            raise unavailable.shutting_down()
        return self.renderer, self.limits

    def decode_for_render(self, decoder: msgspec.json.Decoder[Req], body: bytes) -> tuple[Req, Renderer, ModelLimits]:
        """decode_for_model for routes that only render and tokenize (they work on a render-only server)."""
        req = decode_body(decoder, body)
        renderer, limits = self.require_renderer()
        self.check_model(req.model)
        return req, renderer, limits

    def shown_model(self, model: str | None) -> str:
        """The `model` a response shows: the adapter the request named, else the served model's name."""
        loras = self.limits.loras if self.limits is not None else None
        return model if model is not None and loras is not None and loras.get(model) is not None else self.model_name

    def check_model(self, model: str | None) -> None:
        """404 unless `model` names the base or (--enable-lora) a served adapter."""
        loras = self.limits.loras if self.limits is not None else None
        if loras is not None and loras.get(model) is not None:
            return
        if model is not None and model != self.model_name and model not in self.config.model.names():
            raise APIError(
                f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                status=404,
                param="model",
            )

    def decode_for_model(
        self,
        decoder: msgspec.json.Decoder[Req],
        body: bytes,
        on_decode_error: Callable[[msgspec.DecodeError], APIError] = from_decode_error,
    ) -> tuple[Req, AsyncLLM, Renderer, ModelLimits]:
        """Every route's preamble: the body decoded (400, worded by `on_decode_error`), the running parts
        (503), the model named (404)."""
        req = decode_body(decoder, body, on_decode_error)
        llm, renderer, limits = self.require()
        self.check_model(req.model)
        return req, llm, renderer, limits
