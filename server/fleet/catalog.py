"""What `--models-dir DIR` serves: every HF folder with a config.json and every .gguf file in DIR (or a symlink to
either), by name (the folder's, or the file's without .gguf), and each one's settings from DIR/models.yaml (or
models.json): `{name: {setting: value}}`, settings named as their flags (dashes or underscores) over the
server-wide flags."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

import yaml

from engine.lora.config import parse_lora_modules
from server.config import SETTINGS, ServerConfig
from server.config.values import parse_setting

SETTINGS_FILES = ("models.yaml", "models.yml", "models.json")
# The sub-configs a model may set on its own; the rest (listening, API processes, the folder itself) is the server's.
PER_MODEL_GROUPS = frozenset({"model", "lora", "scheduling", "engine", "outputs", "media"})
_HINTS: dict[str, Any] = {
    name: hint for f in dataclasses.fields(ServerConfig) for name, hint in get_type_hints(f.default_factory).items()
}


@dataclass(frozen=True)
class ModelEntry:
    name: str
    path: Path  # the folder or .gguf file as found in DIR (symlinks kept: the name is the link's)
    settings: dict[str, Any] = field(default_factory=dict)  # this model's settings over the server's

    def config(self, base: ServerConfig) -> ServerConfig:
        """This model's own ServerConfig: the server's flags, its settings, no chat page (the front serves it).
        Raises ValueError (a bad setting, a broken .gguf file): the model fails to load, the others serve."""
        groups: dict[str, dict[str, Any]] = {
            "model": {"model": str(self.path), "served_model_name": self.name},
            "http": {"disable_ui": True},
        }
        for name, value in self.settings.items():
            groups.setdefault(SETTINGS[name], {})[name] = value
        changed = {group: dataclasses.replace(getattr(base, group), **values) for group, values in groups.items()}
        return dataclasses.replace(base, **changed, models=dataclasses.replace(base.models, models_dir=None))


def _is_model(path: Path) -> bool:
    return (path.is_dir() and (path / "config.json").is_file()) or (path.is_file() and path.suffix == ".gguf")


def _setting(model: str, key: str, value: Any) -> tuple[str, Any]:
    name = key.replace("-", "_")
    if name not in SETTINGS or SETTINGS[name] not in PER_MODEL_GROUPS or name in ("model", "served_model_name"):
        raise ValueError(f"models settings of {model!r}: {key!r} is not a per-model setting")
    hint = _HINTS[name]
    if isinstance(value, str) and hint is not str:  # "2GiB", JSON text, "0.5": read as the flag's text is
        return name, parse_setting(name, hint, value, f"{model}.{key}")
    if isinstance(value, list) and name == "lora_modules":  # `name=path` items or {"name", "path"} mappings
        return name, parse_lora_modules([v if isinstance(v, str) else json.dumps(v) for v in value])
    return name, value


def read_settings(folder: Path) -> dict[str, dict[str, Any]]:
    """models.yaml / models.json in `folder` ({} when absent), each model's settings checked by name and type."""
    for filename in SETTINGS_FILES:
        path = folder / filename
        if path.is_file():
            text = path.read_text(encoding="utf-8")
            raw = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
            break
    else:
        return {}
    if raw is None:
        return {}
    if not isinstance(raw, dict) or not all(isinstance(v, dict) for v in raw.values()):
        raise ValueError(f"{path}: expected a mapping of model name -> {{setting: value}}")
    return {
        str(model): dict(_setting(str(model), str(k), v) for k, v in values.items()) for model, values in raw.items()
    }


def scan(folder: str | Path) -> dict[str, ModelEntry]:
    """Every model in `folder`, by name, with its settings. ValueError: no such folder, a settings file that is
    wrong, settings for a model the folder does not hold."""
    root = Path(folder)
    if not root.is_dir():
        raise ValueError(f"--models-dir {folder}: not a folder")
    found: dict[str, Path] = {}
    for path in sorted(root.iterdir()):
        if path.name.startswith(".") or not _is_model(path):
            continue
        found[path.name[: -len(".gguf")] if path.suffix == ".gguf" and path.is_file() else path.name] = path
    settings = read_settings(root)
    unknown = sorted(set(settings) - set(found))
    if unknown:
        raise ValueError(f"--models-dir {folder}: settings for models it does not hold: {', '.join(unknown)}")
    return {name: ModelEntry(name, path, settings.get(name, {})) for name, path in found.items()}
