"""The adapters this API process serves: name -> folder, checked, with the content digest the engine keys on.

Static ones come from --lora-modules at start-up (a bad one stops start-up); with
SPINDLE_ALLOW_RUNTIME_LORA_UPDATING=1, /v1/load_lora_adapter and /v1/unload_lora_adapter change the set. A
request's `model` names the base or an adapter (`resolve`); an unloaded name is gone at once for new requests,
while requests already sent finish under the adapter (the engine keeps a live request's adapter loaded).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from engine.lora.config import LoRAModule
from engine.lora.peft_files import AdapterError, BaseDims, read_adapter
from engine.messages import LoRARequest
from engine.models.checkpoint_meta import read_config
from server.lora.shared import Entries, SharedAdapters

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
        self._adapters: dict[str, Adapter] = {}
        self.shared: SharedAdapters | None = None  # --api-server-count above 1: the set every process sees

    @property
    def adapters(self) -> dict[str, Adapter]:
        """name -> adapter, as another API process may have changed it (a runtime load or unload)."""
        if self.shared is not None and (entries := self.shared.changed()) is not None:
            self._adapters = _from_entries(entries)
        return self._adapters

    @classmethod
    def from_files(
        cls, model_path: str, max_rank: int, base_name: str, modules: tuple[LoRAModule, ...]
    ) -> LoRARegistry:
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
        """AdapterError for a name already served without `replace` (blocking when shared: off the loop)."""

        def change(entries: Entries) -> None:
            if adapter.name in entries and not replace:
                raise AdapterError(
                    f"the adapter {adapter.name!r} is already loaded; unload it first or load with load_inplace: true"
                )
            entries[adapter.name] = _entry(adapter)

        self._change(change)

    def remove(self, name: str) -> bool:
        """Whether `name` was served (blocking when shared: off the loop)."""
        found = False

        def change(entries: Entries) -> None:
            nonlocal found
            found = entries.pop(name, None) is not None

        self._change(change)
        return found

    def _change(self, change: Callable[[Entries], None]) -> None:
        current = {name: _entry(a) for name, a in self.adapters.items()}
        if self.shared is None:
            change(current)
        else:
            current = self.shared.update(current, change)
        self._adapters = _from_entries(current)

    def get(self, model: str | None) -> Adapter | None:
        return self.adapters.get(model) if model is not None else None


def _entry(a: Adapter) -> dict[str, object]:
    r = a.request
    return {
        "name": a.name,
        "path": a.path,
        "parent": a.parent,
        "rank": a.rank,
        "created": a.created,
        "request": [r.name, r.path, r.digest],
    }


def _from_entries(entries: Entries) -> dict[str, Adapter]:
    return {
        name: Adapter(e["name"], e["path"], e["parent"], e["rank"], LoRARequest(*e["request"]), e["created"])
        for name, e in entries.items()
    }
