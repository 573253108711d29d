"""`spindle render --model M`: the render-only server's config and model limits (server/app.py builds its app).

Routes: /tokenize, /detokenize, /v1/completions/render, /v1/chat/completions/render, /v1/models, /health,
/version, /metrics; the same validation, template sandbox (render workers), API keys, CORS and root path as
`spindle serve`. The generation routes answer 404 naming `spindle serve`. For a router that places requests
by prefix (it tokenizes here, hashes the ids, picks a replica): docs/deployment.md.

No torch in this process or its render workers: the model's limits come from config.json and
generation_config.json as the engine reads them (engine/models/loader.py, engine/model_runner.py), read here
without importing the engine's model code. tests/e2e/test_render_only.py checks /proc/PID/maps for libtorch.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from server.config import ServerConfig
from server.pipeline.input_processor import ModelLimits

# generation_config.json keys that become default sampling parameters: engine/models/loader.py _SAMPLING_KEYS
_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                  "presence_penalty", "frequency_penalty", "max_new_tokens")


def render_config(config: ServerConfig) -> ServerConfig:
    """The config `spindle render` runs with; ValueError (exit 2) for what a render-only server cannot do."""
    if config.model is None:
        raise ValueError("spindle render needs --model (a local checkpoint folder with the tokenizer)")
    if config.headless:
        raise ValueError("spindle render runs no engine ranks: --headless does not apply")
    return dataclasses.replace(config, render_only=True)


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} should hold a JSON object")
    return data


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def checkpoint_limits(config: ServerConfig, tokenizer: Any) -> ModelLimits:
    """The ModelLimits the full server builds from the engine's Ready, read from the checkpoint's files."""
    from engine.messages import Ready

    from server.app import limits_for

    folder = Path(config.model_path)
    if not (folder / "config.json").is_file():
        raise ValueError(f"{folder} has no config.json; pass a Hugging Face format checkpoint folder")
    cfg = _json(folder / "config.json")
    max_pos = int(cfg.get("max_position_embeddings", 4096))
    if config.max_model_len is not None and config.max_model_len > max_pos:
        raise ValueError(f"--max-model-len {config.max_model_len} exceeds the model's max_position_embeddings "
                         f"{max_pos}; pass at most {max_pos}")
    gen_file = folder / "generation_config.json"
    gen = _json(gen_file) if gen_file.is_file() else {}
    eos = _ids(gen.get("eos_token_id")) or _ids(cfg.get("eos_token_id"))
    defaults = {k: gen[k] for k in _SAMPLING_KEYS if isinstance(gen.get(k), (int, float))}
    vocab = cfg.get("vocab_size", (cfg.get("text_config") or {}).get("vocab_size"))  # VL configs may nest it
    if vocab is None:
        raise ValueError(f"{folder / 'config.json'} has no vocab_size")
    ready = Ready(max_model_len=config.max_model_len or max_pos, vocab_size=int(vocab),
                  eos_token_ids=eos, num_blocks=0, block_size=config.block_size, model_dtype="none",
                  generation_defaults=defaults)
    return limits_for(config, ready, tokenizer)
