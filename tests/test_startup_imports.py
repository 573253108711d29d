"""What a server start imports for a checkpoint folder: never the gguf package (it pulls in mistral_common, +0.5 s
of CPU in each of the API process and the engine); gguf is imported only where a GGUF file is read."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.test_import_graph import REPO

HEAVY = ("gguf", "mistral_common")
# the API process's and the engine's imports up to loading a safetensors checkpoint (the CLI, the app, the loader,
# the engine core with its kernels and layers)
STARTS = {
    "api": ["server.cli", "server.app"],
    "engine": ["engine.__main__", "engine.core.engine_core", "engine.models.loader", "engine.layers.quant_linear"],
}


@pytest.mark.parametrize("process", sorted(STARTS))
def test_a_start_on_a_checkpoint_folder_does_not_import_gguf(process: str) -> None:
    script = "import importlib, sys\n"
    script += "".join(f"importlib.import_module({m!r})\n" for m in STARTS[process])
    script += f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-2] == "[]", out.stdout
