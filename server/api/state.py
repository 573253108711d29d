"""What the routes share: filled in by the app's lifespan once the engine and renderer are up."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import msgspec

from server.config import ServerConfig
from server.http.errors import APIError, from_decode_error
from server.pipeline.input_processor import ModelLimits
from server.protocol.openai import decode_request

if TYPE_CHECKING:
    from server.pipeline.async_llm import AsyncLLM


class _NamesModel(Protocol):
    @property
    def model(self) -> str | None: ...


Req = TypeVar("Req", bound=_NamesModel)


@dataclass
class AppState:
    config: ServerConfig
    model_name: str
    llm: AsyncLLM | None = None
    renderer: Any = None  # server.render.renderer.Renderer (or a test stand-in with the same methods)
    mm_pool: Any = None  # a vision model: the image worker's WorkerPool (server/multimodal/images.py)
    limits: ModelLimits | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    stopping: bool = False

    def require(self) -> tuple[AsyncLLM, Any, ModelLimits]:
        """The running parts, or a 503 saying why requests cannot be served now."""
        llm, renderer, limits = self.llm, self.renderer, self.limits
        if llm is None or renderer is None or limits is None:
            raise APIError("The server is still starting; retry in a moment.", status=503, retry_after=1)
        if llm.dead is not None:
            raise APIError(f"The engine is not running ({llm.dead}); retry against a restarted server.", status=503)
        if self.stopping:
            raise APIError("The server is shutting down; retry against another instance.", status=503)
        return llm, renderer, limits

    def require_renderer(self) -> tuple[Any, ModelLimits]:
        """The renderer and limits (503 until they are up); a full server also needs its engine running, as
        for any request, while a render-only one (server/render_app.py) has no engine."""
        if not self.config.render_only:
            _llm, renderer, limits = self.require()
            return renderer, limits
        if self.renderer is None or self.limits is None:
            raise APIError("The server is still starting; retry in a moment.", status=503, retry_after=1)
        if self.stopping:
            raise APIError("The server is shutting down; retry against another instance.", status=503)
        return self.renderer, self.limits

    def decode_for_render(self, decoder: msgspec.json.Decoder[Req], body: bytes) -> tuple[Req, Any, ModelLimits]:
        """decode_for_model for routes that only render and tokenize (they work on a render-only server)."""
        try:
            req = decode_request(decoder, body)
        except msgspec.DecodeError as e:
            raise from_decode_error(e) from None
        renderer, limits = self.require_renderer()
        self.check_model(req.model)
        return req, renderer, limits

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name and model != self.config.model:
            raise APIError(f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                           status=404, param="model")

    def decode_for_model(self, decoder: msgspec.json.Decoder[Req], body: bytes,
                         on_decode_error: Callable[[msgspec.DecodeError], APIError] = from_decode_error,
                         ) -> tuple[Req, AsyncLLM, Any, ModelLimits]:
        """Every route's preamble: the body decoded (400, worded by `on_decode_error`), the running parts
        (503), the model named (404)."""
        try:
            req = decode_request(decoder, body)
        except msgspec.DecodeError as e:
            raise on_decode_error(e) from None
        llm, renderer, limits = self.require()
        self.check_model(req.model)
        return req, llm, renderer, limits
