"""The adapters this API process serves: name -> folder, checked, with the content digest the engine keys on.

Static ones come from --lora-modules at start-up (a bad one stops start-up); with
SPINDLE_ALLOW_RUNTIME_LORA_UPDATING=1, /v1/load_lora_adapter and /v1/unload_lora_adapter change the set. A
request's `model` names the base or an adapter (`resolve`); an unloaded name is gone at once for new requests,
while requests already sent finish under the adapter (the engine keeps a live request's adapter loaded).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from engine.lora.config import LoRAModule
from engine.lora.peft_files import AdapterError, BaseDims, read_adapter
from engine.messages import LoRARequest
from engine.models.checkpoint_meta import read_config

log = logging.getLogger("spindle.server")


@dataclass(frozen=True)
class Adapter:
    name: str
    path: str
    parent: str  # the base model's name (/v1/models' `parent`)
    rank: int
    request: LoRARequest  # what each engine request under this adapter carries
    created: int = field(default_factory=lambda: int(time.time()))


class LoRARegistry:
    def __init__(self, base: BaseDims, max_rank: int, base_name: str, model_path: str | None = None) -> None:
        self.base, self.max_rank, self.base_name = base, max_rank, base_name
        self.base_names = {base_name} | ({model_path} if model_path else set())  # what names the base
        self.adapters: dict[str, Adapter] = {}

    @classmethod
    def from_files(cls, model_path: str, max_rank: int, base_name: str,
                   modules: tuple[LoRAModule, ...]) -> LoRARegistry:
        """The registry with the static adapters loaded (blocking: run it in a thread). ValueError naming the
        adapter that fails."""
        registry = cls(BaseDims.from_config(read_config(Path(model_path))), max_rank, base_name, model_path)
        for m in modules:
            try:
                registry.add(registry.check(m.name, m.path, m.base_model_name))
            except AdapterError as e:
                raise ValueError(f"--lora-modules {m.name}={m.path}: {e}") from None
            log.info("serving LoRA adapter %s from %s", m.name, m.path)
        return registry

    def check(self, name: str, path: str, parent: str | None = None) -> Adapter:
        """The adapter at `path`, read and checked against the base (blocking); AdapterError says why not."""
        if name in self.base_names:
            raise AdapterError(f"the name {name!r} is the base model's; pick another")
        spec = read_adapter(path, self.base, self.max_rank)
        return Adapter(name, path, parent or self.base_name, spec.rank, LoRARequest(name, path, spec.digest))

    def add(self, adapter: Adapter, replace: bool = False) -> None:
        if adapter.name in self.adapters and not replace:
            raise AdapterError(f"the adapter {adapter.name!r} is already loaded; unload it first or load with "
                               "load_inplace: true")
        self.adapters[adapter.name] = adapter

    def remove(self, name: str) -> Adapter | None:
        return self.adapters.pop(name, None)

    def get(self, model: str | None) -> Adapter | None:
        return self.adapters.get(model) if model is not None else None
