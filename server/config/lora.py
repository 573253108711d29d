"""LoRA adapters per request (vLLM's flags; engine/lora/): --lora-modules load at start-up; more at run time only
with SPINDLE_ALLOW_RUNTIME_LORA_UPDATING=1 (/v1/load_lora_adapter, /v1/unload_lora_adapter). Their names against
the model's are checked where both are known (server/config/server.py)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.lora.config import LoRAModule, check_lora_settings


@dataclass(frozen=True)
class LoRAConfig:
    enable_lora: bool = False
    lora_modules: tuple[LoRAModule, ...] = ()
    max_loras: int = 1  # distinct adapters in one engine step
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # adapters kept loaded in the engine (None: max_loras)
    lora_dtype: str = "auto"  # auto: the model's dtype
    allow_runtime_lora_updating: bool = False

    def __post_init__(self) -> None:
        check_lora_settings(self.max_loras, self.max_lora_rank, self.max_cpu_loras, self.lora_dtype)
