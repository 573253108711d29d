"""The render-only server's import graph stays torch-free (tests/e2e/test_render_only.py checks the processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.models.checkpoint_meta import ModelLoadError
from server.cli import main
from server.config import RENDER_NEEDS_MODEL, ServerConfig
from server.render_app import checkpoint_limits


def test_render_server_modules_import_no_torch() -> None:
    code = (
        "import sys, server.cli, server.app, server.render_app, server.render.render_worker, "
        "server.metrics.vllm_names, "
        "server.http.deploy; bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton')); "
        "assert not bad, bad"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


_NO_TORCH = "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton')); assert not bad, bad"


def _plain_hypercorn_env(**spindle: str) -> dict[str, str]:
    """This process's environment without SPINDLE_* settings, plus `spindle` (as `SPINDLE_RENDER_ONLY=1 hypercorn
    'server.app:create_app()'` would read them)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPINDLE_")}
    return {**env, **{f"SPINDLE_{k.upper()}": v for k, v in spindle.items()}}


def test_render_only_from_env_needs_a_model_as_spindle_render_does(capsys: pytest.CaptureFixture[str]) -> None:
    """create_app() under plain Hypercorn with SPINDLE_RENDER_ONLY=1 and no model: `spindle render`'s error, and
    no torch imported on the way (the demo checkpoint, which needs torch, is never built for it)."""
    code = (
        "import sys\nfrom server.app import create_app\ntry:\n    create_app()\nexcept ValueError as e:\n"
        "    print(e)\nelse:\n    raise SystemExit('built without a model')\n" + _NO_TORCH
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=_plain_hypercorn_env(render_only="1"),
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == RENDER_NEEDS_MODEL
    assert main(["render"]) == 2
    assert capsys.readouterr().err.strip() == f"spindle: {RENDER_NEEDS_MODEL}"


def test_render_only_from_env_with_a_model_builds_without_torch(tmp_path: Path) -> None:
    code = (
        "import sys\nfrom server.app import create_app\nconfig = create_app().state_holder.config\n"
        "assert config.parallel.render_only and config.model.model == sys.argv[1], config\n" + _NO_TORCH
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=_plain_hypercorn_env(render_only="1", model=str(tmp_path)),
    )
    assert out.returncode == 0, out.stderr


def test_render_only_refuses_headless() -> None:
    with pytest.raises(ValueError, match="--headless does not apply"):
        ServerConfig.from_settings(
            model="/m",
            render_only=True,
            headless=True,
            node_rank=1,
            nnodes=2,
            tensor_parallel_size=2,
            master_port=29500,
        )


def test_checkpoint_limits_read_the_files_as_the_engine_does(tmp_path: Path) -> None:
    """config.json (a vision config nests the text model's settings) and generation_config.json."""
    (tmp_path / "config.json").write_text(
        json.dumps({"text_config": {"vocab_size": 300, "max_position_embeddings": 128}, "eos_token_id": 5})
    )
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [7, 8], "temperature": 0.6, "top_k": 20, "do_sample": True, "top_p": "x"})
    )
    limits = checkpoint_limits(ServerConfig.from_settings(model=str(tmp_path), render_only=True), None)
    assert (limits.max_model_len, limits.vocab_size, limits.eos_token_ids) == (128, 300, (7, 8))
    assert limits.generation_defaults == {"temperature": 0.6, "top_k": 20}
    assert (
        checkpoint_limits(ServerConfig.from_settings(model=str(tmp_path), max_model_len=64), None).max_model_len == 64
    )
    with pytest.raises(ModelLoadError, match="exceeds the model's max_position_embeddings 128"):
        checkpoint_limits(ServerConfig.from_settings(model=str(tmp_path), max_model_len=129), None)
