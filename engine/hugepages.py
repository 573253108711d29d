"""Transparent huge pages for a process's heap, through glibc's malloc tunable `glibc.malloc.hugetlb=1`.

A CPU decode step streams every weight once; on 4 KiB pages that is a TLB miss every 4 KiB (about 250,000
per step on Qwen2.5-0.5B's 1 GB). With the kernel's THP mode "madvise" (the common default) memory gets
2 MiB pages only where asked for, and torch / oneDNN never ask; glibc does for every block it maps when
the tunable is set. Products and plain reads of the weights run faster on them
(bench/README.md, "Huge pages"); results are bitwise the same.

glibc reads tunables only when a process starts, so an engine process re-executes itself once, before it loads
torch, with the tunable added to GLIBC_TUNABLES; only for a checkpoint of MIN_WEIGHT_BYTES or more, since the
re-exec and the huge-page faults cost a small model's start-up ~2 s (same section). A GLIBC_TUNABLES that
already names `glibc.malloc.hugetlb` is left as it is: `GLIBC_TUNABLES=glibc.malloc.hugetlb=0` turns this off.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

TUNABLE = "glibc.malloc.hugetlb"
MIN_GLIBC = (2, 35)  # the first glibc with the tunable
# below this many bytes of weights the TLB saving is small and the re-exec's start-up cost (~2 s) is not
MIN_WEIGHT_BYTES = 128 << 20
# the folder a GGUF file is derived into names its weights here (engine/gguf/folder.py MARKER; not imported: this
# module runs before the engine's imports)
GGUF_MARKER = "gguf.json"


def _glibc_has_tunable() -> bool:
    name, version = platform.libc_ver()
    if sys.platform != "linux" or name != "glibc":
        return False
    try:
        return tuple(int(p) for p in version.split(".")[:2]) >= MIN_GLIBC
    except ValueError:
        return False


def huge_pages_env(env: Mapping[str, str]) -> dict[str, str] | None:
    """`env` with the tunable added to GLIBC_TUNABLES, or None when there is nothing to add (already named
    there, or not a glibc that knows it)."""
    tunables = env.get("GLIBC_TUNABLES", "")
    if any(t.split("=", 1)[0] == TUNABLE for t in tunables.split(":")) or not _glibc_has_tunable():
        return None
    return {**env, "GLIBC_TUNABLES": f"{tunables}:{TUNABLE}=1" if tunables else f"{TUNABLE}=1"}


def checkpoint_bytes(model: str | None) -> int:
    """Bytes of weights of a local checkpoint folder: its weight files, or for a folder derived from a GGUF file
    the tensor bytes its gguf.json records (0 for the built-in demo, a missing folder or an unreadable marker)."""
    folder = Path(model) if model else None
    if folder is None or not folder.is_dir():
        return 0
    files = sum(f.stat().st_size for pattern in ("*.safetensors", "*.bin", "*.pt") for f in folder.glob(pattern))
    return files + _gguf_tensor_bytes(folder / GGUF_MARKER)


def _gguf_tensor_bytes(marker: Path) -> int:
    """gguf.json's `tensor_bytes` (engine/gguf/folder.py writes it); 0 when absent or not a count."""
    try:
        value = json.loads(marker.read_text()).get("tensor_bytes", 0)
    except (OSError, ValueError, AttributeError):
        return 0
    return value if isinstance(value, int) and value > 0 else 0


def engine_model(argv: Sequence[str]) -> str | None:
    """The `model` of `python -m engine --config JSON` (None when the command line does not say)."""
    for flag, value in zip(argv, argv[1:]):
        if flag == "--config":
            try:
                model = json.loads(value).get("model")
            except (ValueError, AttributeError):
                return None
            return model if isinstance(model, str) else None
    return None


def reexec_for_model(argv: Sequence[str]) -> None:
    """The engine's entry: huge pages only for a checkpoint big enough to gain from them."""
    if checkpoint_bytes(engine_model(argv)) >= MIN_WEIGHT_BYTES:
        reexec_with_huge_pages()


def reexec_with_huge_pages() -> None:
    """Replace this process by the same command line with the tunable set (same pid, same open descriptors);
    returns when it is set already or does not apply. Call it first thing, before heavy imports."""
    env = huge_pages_env(os.environ)
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
