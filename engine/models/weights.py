"""Reading a checkpoint's weights: name -> tensor over its safetensors files (the loader's error and JSON
reading live in the torch-free engine/models/checkpoint_meta.py).

The loader (engine/models/loader.py) reads the whole model through `Weights`; a tensor-parallel rank reads
its slices through a subclass (engine/distributed/sharding.py) that overrides `_read`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.models.checkpoint_meta import ModelLoadError as ModelLoadError
from engine.models.checkpoint_meta import read_json as read_json
from engine.models.progress import LoadProgress


class Weights:
    """Name -> tensor over one or many safetensors files, opened lazily."""

    def __init__(self, folder: Path, dtype: torch.dtype, device: torch.device, *, quiet: bool = False) -> None:
        """quiet: no progress lines (tensor-parallel ranks other than 0: the load is logged once)."""
        self.dtype, self.device = dtype, device
        index = folder / "model.safetensors.index.json"
        if index.exists():
            weight_map: dict[str, str] = read_json(index).get("weight_map", {})
            missing = sorted({f for f in weight_map.values() if not (folder / f).exists()})
            if missing:
                raise ModelLoadError(f"{folder} is missing shard(s) {', '.join(missing)} named in {index.name}")
            self.files = {name: folder / f for name, f in weight_map.items()}
        else:
            files = sorted(folder.glob("*.safetensors"))
            if not files:
                raise ModelLoadError(
                    f"{folder} holds no *.safetensors weights; only safetensors "
                    "checkpoints are supported (convert .bin files with save_pretrained)"
                )
            self.files = {}
            for f in files:
                with safe_open(f, framework="pt") as h:
                    self.files.update({name: f for name in h.keys()})
        self._handles: dict[Path, Any] = {}
        self.progress = LoadProgress(len(self.files), quiet=quiet)

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.files:
            raise ModelLoadError(f"weight {name!r} is missing from the checkpoint's safetensors files")
        f = self.files[name]
        if f not in self._handles:
            self._handles[f] = safe_open(f, framework="pt")
        tensor = self._read(self._handles[f], name).to(device=self.device, dtype=self.dtype)
        self.progress.advance()
        return tensor

    def _read(self, handle: Any, name: str) -> torch.Tensor:
        """The tensor as this process needs it (a tensor-parallel rank: its slice only)."""
        tensor: torch.Tensor = handle.get_tensor(name)
        return tensor
