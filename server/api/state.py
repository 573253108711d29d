"""What the routes share: filled in by the app's lifespan once the engine and renderer are up."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from server.config import ServerConfig
from server.http.errors import APIError
from server.pipeline.input_processor import ModelLimits

if TYPE_CHECKING:
    from server.pipeline.async_llm import AsyncLLM


@dataclass
class AppState:
    config: ServerConfig
    model_name: str
    llm: AsyncLLM | None = None
    renderer: Any = None  # server.render.renderer.Renderer (or a test stand-in with the same methods)
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

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name and model != self.config.model:
            raise APIError(f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                           status=404, param="model")
