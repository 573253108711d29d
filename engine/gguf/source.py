"""Which GGUF file(s) a `--model` value names, their headers, and the start-up checks on them.

`--model` may name a .gguf file, a folder holding one (and no config.json), or the first part of a split
model (`name-00001-of-00003.gguf`, the other parts beside it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.gguf.header import (
    MAGIC,
    SUPPORTED_TYPES,
    GGUFError,
    Header,
    TensorInfo,
    read_header,
    type_name,
)

# GGUF general.architecture -> the Hugging Face architecture whose model class serves it here
ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}
_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclass(frozen=True)
class GGUFModel:
    """The file(s) of one GGUF model: metadata from the first, tensors from all."""

    files: tuple[Path, ...]
    headers: tuple[Header, ...]

    @property
    def metadata(self) -> dict[str, Any]:
        return self.headers[0].metadata

    @property
    def architecture(self) -> str:
        return self.headers[0].architecture

    @property
    def name(self) -> str:
        """The served name by default: the file's name (a split model's without the part suffix)."""
        m = _SPLIT.match(self.files[0].name)
        return f"{m['stem']}.gguf" if m else self.files[0].name

    @property
    def tensor_bytes(self) -> int:
        return sum(h.tensor_bytes for h in self.headers)

    def tensors(self) -> dict[str, tuple[int, TensorInfo]]:
        """tensor name -> (index of its file, its entry)."""
        return {name: (i, t) for i, h in enumerate(self.headers) for name, t in h.tensors.items()}


def _is_gguf_file(path: Path) -> bool:
    if path.suffix == ".gguf":
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


def gguf_file_of(model: str | Path) -> Path | None:
    """The GGUF file `model` names (a file, or a folder with no config.json holding one), else None."""
    path = Path(model).expanduser()
    if path.is_file():
        return path
    if not path.is_dir() or (path / "config.json").exists():
        return None
    found = sorted(p for p in path.glob("*.gguf") if p.is_file())
    firsts = [p for p in found if not (m := _SPLIT.match(p.name)) or int(m["no"]) == 1]
    if len(firsts) > 1:
        raise GGUFError(f"{path} holds several GGUF models ({', '.join(p.name for p in firsts)}); "
                        "pass --model with the file to serve")
    return firsts[0] if firsts else None


def split_parts(first: Path) -> tuple[Path, ...]:
    """All parts of a split model, given any part (one file: itself)."""
    m = _SPLIT.match(first.name)
    if not m:
        return (first,)
    count = int(m["count"])
    parts = tuple(first.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1))
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise GGUFError(f"{first}: split model part(s) {', '.join(missing)} missing beside it")
    return parts


def open_model(file: Path) -> GGUFModel:
    """The model's headers, checked: a supported architecture and tensor types (GGUFError otherwise)."""
    if not _is_gguf_file(file):
        raise GGUFError(f"--model {file} is a file but not a GGUF file; pass a .gguf file or a checkpoint folder")
    files = split_parts(file)
    model = GGUFModel(files, tuple(read_header(f) for f in files))
    arch = model.architecture
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{file}: GGUF architecture {arch or '(none: no general.architecture)'!r} is not "
                        f"supported; supported: {', '.join(ARCHITECTURES)}")
    for header in model.headers:
        for t in header.tensors.values():
            if t.ggml_type not in SUPPORTED_TYPES:
                raise GGUFError(f"{header.path}: tensor {t.name!r} has type {type_name(t.ggml_type)}, which is not "
                                f"supported; supported: {', '.join(sorted(type_name(x) for x in SUPPORTED_TYPES))}")
    return model
