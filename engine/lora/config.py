"""The LoRA settings (vLLM's flags) and their checks, shared by EngineConfig and the server's config; no torch."""

from __future__ import annotations

import json
from dataclasses import dataclass

LORA_DTYPES = ("auto", "float32", "bfloat16", "float16")
MAX_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's choices for --max-lora-rank


def check_lora_settings(max_loras: int, max_lora_rank: int, max_cpu_loras: int | None, lora_dtype: str) -> None:
    """ValueError naming the flag when a setting is out of range."""
    if max_loras < 1:
        raise ValueError(f"--max-loras must be at least 1, got {max_loras}")
    if max_lora_rank not in MAX_LORA_RANKS:
        raise ValueError(f"--max-lora-rank must be one of {', '.join(map(str, MAX_LORA_RANKS))}, got {max_lora_rank}")
    if max_cpu_loras is not None and max_cpu_loras < max_loras:
        raise ValueError(f"--max-cpu-loras ({max_cpu_loras}) must be at least --max-loras ({max_loras})")
    if lora_dtype not in LORA_DTYPES:
        raise ValueError(f"--lora-dtype must be one of {', '.join(LORA_DTYPES)}, got {lora_dtype!r}")


@dataclass(frozen=True)
class LoRAModule:
    """One --lora-modules item: an adapter served under `name` from the folder `path`."""

    name: str
    path: str
    base_model_name: str | None = None  # /v1/models' `parent` (None: the served model name)


def parse_lora_modules(items: list[str] | tuple[str, ...] | str) -> tuple[LoRAModule, ...]:
    """vLLM's --lora-modules items: `name=path`, or JSON `{"name", "path", "base_model_name"}` (a JSON list too,
    as SPINDLE_LORA_MODULES may hold); ValueError naming the bad item."""
    if isinstance(items, str):
        text = items.strip()
        items = [json.dumps(x) for x in json.loads(text)] if text.startswith("[") else text.split()
    out = []
    for item in items:
        if item.lstrip().startswith("{"):
            try:
                obj = json.loads(item)
                out.append(LoRAModule(str(obj["name"]), str(obj["path"]), obj.get("base_model_name")))
            except (ValueError, KeyError, TypeError):
                raise ValueError(f'--lora-modules: {item!r} is not JSON with "name" and "path"') from None
            continue
        name, eq, path = item.partition("=")
        if not eq or not name or not path:
            raise ValueError(f'--lora-modules: {item!r} should be name=path or JSON {{"name", "path"}}')
        out.append(LoRAModule(name, path))
    return tuple(out)


def check_lora_serving(enable: bool, modules: tuple[LoRAModule, ...], model_name: str, runtime_updates: bool) -> None:
    """The server's LoRA flags together (ServerConfig calls it); ValueError naming the flag."""
    if not enable and (modules or runtime_updates):
        raise ValueError("--lora-modules and SPINDLE_ALLOW_RUNTIME_LORA_UPDATING need --enable-lora")
    names = [m.name for m in modules]
    if len(set(names)) < len(names) or model_name in names:
        raise ValueError(f"--lora-modules: names must be unique and differ from the model's, got {names}")
