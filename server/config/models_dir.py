"""Several models behind one server (server/fleet/): the folder they are found in, how many stay loaded, and how
long an idle one stays."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelsDirConfig:
    models_dir: str | None = None  # every HF folder (config.json) and .gguf file in it, served by name
    max_loaded_models: int = 1  # engines running at once; the least recently used idle one is unloaded first
    model_idle_timeout: float | None = None  # seconds without requests before a model is unloaded; None: never

    def __post_init__(self) -> None:
        if self.max_loaded_models < 1:
            raise ValueError(f"--max-loaded-models must be at least 1, got {self.max_loaded_models}")
        if self.model_idle_timeout is not None and self.model_idle_timeout <= 0:
            raise ValueError(f"--model-idle-timeout must be positive, got {self.model_idle_timeout}")
