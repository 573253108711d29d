"""An adapter's tensors, loaded on CPU once its files passed engine/lora/peft_files.py's checks."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from engine.lora.peft_files import TARGETS, WEIGHTS_FILE, AdapterError, AdapterSpec, BaseDims, read_adapter


@dataclass(frozen=True)
class ModuleWeights:
    """One projection's A [r, in] and B [out, r] (in the LoRA dtype) and its scaling."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float


@dataclass(frozen=True)
class LoadedAdapter:
    spec: AdapterSpec
    # (layer, fused projection: qkv | o | gate_up | down) -> member name (q_proj, ...) -> its weights
    weights: dict[tuple[int, str], dict[str, ModuleWeights]]

    @property
    def digest(self) -> str:
        return self.spec.digest


def load_adapter(
    path: str, base: BaseDims, max_rank: int, dtype: torch.dtype, expect_digest: str | None = None
) -> LoadedAdapter:
    """The adapter's tensors on CPU; AdapterError if its files fail a check or changed since `expect_digest`."""
    spec = read_adapter(path, base, max_rank)
    if expect_digest is not None and spec.digest != expect_digest:
        raise AdapterError(
            f"the adapter files at {path!r} changed since the adapter was registered; load it "
            "again (load_inplace) to serve the new weights"
        )
    weights: dict[tuple[int, str], dict[str, ModuleWeights]] = {}
    try:
        with safe_open(str(Path(path) / WEIGHTS_FILE), framework="pt") as f:
            for m in spec.modules:
                a, b = f.get_tensor(m.a_key).to(dtype), f.get_tensor(m.b_key).to(dtype)
                weights.setdefault((m.layer, TARGETS[m.name]), {})[m.name] = ModuleWeights(a, b, m.scaling)
    except SafetensorError as e:
        raise AdapterError(f"cannot read {WEIGHTS_FILE}: {e}") from None
    return LoadedAdapter(spec, weights)
