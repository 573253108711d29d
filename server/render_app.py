"""`spindle render --model M`: the render-only server's model limits (server/app.py builds its app).

Routes: /tokenize, /detokenize, /v1/completions/render, /v1/chat/completions/render, /v1/models, /health,
/version, /metrics; the same validation, template sandbox (render workers), API keys, CORS and root path as
`spindle serve`. The generation routes answer 404 naming `spindle serve`. For a router that places requests
by prefix (it tokenizes here, hashes the ids, picks a replica): docs/deployment.md. Its config is checked in
server/config/ (a model folder is required, `spindle render` and SPINDLE_RENDER_ONLY=1 alike).

No torch in this process or its render workers: the model's limits come from config.json and
generation_config.json through engine/models/checkpoint_meta.py, the torch-free reader the engine's loader
uses too. tests/e2e/test_render_only.py checks /proc/PID/maps for libtorch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.messages import Ready
from engine.models import checkpoint_meta
from server.config import ServerConfig
from server.request.input_processor import ModelLimits, limits_for


def checkpoint_limits(config: ServerConfig, tokenizer: Any) -> ModelLimits:
    """The ModelLimits the full server builds from the engine's Ready, read from the checkpoint's files."""
    folder = Path(config.model.model_path)
    cfg = checkpoint_meta.read_config(folder)
    gen = checkpoint_meta.read_generation_config(folder)
    ready = Ready(
        max_model_len=checkpoint_meta.max_model_len(cfg, config.model.max_model_len),
        vocab_size=checkpoint_meta.vocab_size(cfg, folder),
        eos_token_ids=checkpoint_meta.eos_token_ids(cfg, gen),
        num_blocks=0,
        block_size=config.engine.block_size,
        model_dtype="none",
        generation_defaults=checkpoint_meta.generation_defaults(gen),
    )
    return limits_for(config, ready, tokenizer)
