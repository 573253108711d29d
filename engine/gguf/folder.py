"""A GGUF model as a Hugging Face-shaped folder: config.json, generation_config.json and the tokenizer files,
derived once from the file's metadata (through transformers' GGUF conversion) into the spindle cache.

The renderer, structured output (tokenizer.json), /tokenize and the engine's config reading then work on it as
on any checkpoint folder; gguf.json in it names the file(s) the engine reads the tensors from.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from engine.cache_root import cache_root
from engine.gguf.arch_config import derived_config
from engine.gguf.header import GGUFError
from engine.gguf.source import ARCHITECTURES, GGUFModel, gguf_file_of, open_model

MARKER = "gguf.json"
_FORMAT = 1  # bump when the derived files change shape
log = logging.getLogger(__name__)
# transformers' lazy top-level module is not thread-safe on a first import, and --models-dir derives from threads
_IMPORT_LOCK = threading.Lock()
_OWNED = re.compile(r"^\.derive-(?P<host>.+)-(?P<pid>\d+)-[^-]+$")  # _derive_dir's names: host, process id, random
_UNOWNED_STALE_S = 86400.0


def gguf_files(folder: Path) -> list[Path] | None:
    """The GGUF file(s) a derived folder stands for (None: an ordinary checkpoint folder)."""
    marker = folder / MARKER
    if not marker.is_file():
        return None
    return [Path(p) for p in json.loads(marker.read_text())["files"]]


def _key(files: tuple[Path, ...]) -> str:
    stats = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    return hashlib.sha256(json.dumps([_FORMAT, stats]).encode()).hexdigest()[:16]


def _auto_classes() -> tuple[Any, Any]:
    """transformers' AutoConfig and AutoTokenizer, imported under the lock (two threads at once: an ImportError)."""
    with _IMPORT_LOCK:
        # what their gguf_file= paths import lazily, here once (transformers.integrations.gguf races the same way)
        import transformers.integrations.gguf  # noqa: F401
        import transformers.modeling_gguf_pytorch_utils  # noqa: F401
        from transformers import AutoConfig, AutoTokenizer  # why late: only a first start on a GGUF file needs it
    return AutoConfig, AutoTokenizer


def _config(model: GGUFModel, folder: str, name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """config.json and generation_config.json from the file's metadata: ours where transformers' GGUF reader lacks
    the architecture (engine/gguf/arch_config.py), else that reader's."""
    cfg = derived_config(model) or _transformers_config(model, folder, name)
    gen: dict[str, Any] = {
        k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if cfg.get(k) is not None
    }
    return cfg, gen


def _transformers_config(model: GGUFModel, folder: str, name: str) -> dict[str, Any]:
    auto_config, _ = _auto_classes()
    cfg: dict[str, Any] = auto_config.from_pretrained(folder, gguf_file=name).to_dict()
    arch = model.architecture
    hf_arch = ARCHITECTURES[arch]
    if arch == "llama" and "mistral" in str(model.metadata.get("general.name", "")).lower():
        hf_arch = "MistralForCausalLM"  # llama.cpp files Mistral under llama
    cfg["architectures"] = [hf_arch]
    cfg.pop("_name_or_path", None)
    cfg.pop("dtype", None)  # the tensors are quantized: no checkpoint dtype; auto picks float32 on CPU
    return cfg


def _write(model: GGUFModel, out: Path) -> None:
    _, auto_tokenizer = _auto_classes()
    first = model.files[0]
    cfg, gen = _config(model, str(first.parent), first.name)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    if derived_config(model) is not None:  # AutoTokenizer would read the config through transformers' reader first
        with _IMPORT_LOCK:
            from transformers import PreTrainedTokenizerFast as auto_tokenizer  # noqa: N813
    auto_tokenizer.from_pretrained(str(first.parent), gguf_file=first.name).save_pretrained(str(out))
    marker = {
        "files": [str(f.resolve()) for f in model.files],
        "architecture": model.architecture,
        "name": model.name,
        "tensor_bytes": model.tensor_bytes,
    }
    (out / MARKER).write_text(json.dumps(marker, indent=2))


def _derive_dir(root: Path) -> Path:
    """A fresh folder for one derivation, named after its owner (host and process id) for _remove_stale."""
    return Path(tempfile.mkdtemp(prefix=f".derive-{socket.gethostname()}-{os.getpid()}-", dir=root))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _stale(tmp: Path, host: str) -> bool:
    owned = _OWNED.match(tmp.name)
    if owned:
        return owned["host"] == host and not _alive(int(owned["pid"]))
    try:
        return time.time() - tmp.stat().st_mtime > _UNOWNED_STALE_S
    except OSError:  # removed meanwhile
        return False


def _remove_stale(root: Path) -> None:
    """Removes the folders of killed derivations: those whose owner on this host is gone (a folder named without
    its owner only after a day: a derivation takes minutes)."""
    host = socket.gethostname()
    for tmp in root.glob(".derive-*"):
        if _stale(tmp, host):
            log.info("GGUF: removing %s, left by a derivation that was killed", tmp)
            shutil.rmtree(tmp, ignore_errors=True)


def derived_folder(model: GGUFModel) -> Path:
    """The model's HF-shaped folder in the spindle cache, written on first use (atomically: a rename)."""
    root = cache_root() / "gguf"
    folder = root / f"{model.files[0].stem}-{_key(model.files)}"
    if root.is_dir():
        _remove_stale(root)
    if (folder / MARKER).is_file():
        return folder
    root.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    tmp = _derive_dir(root)
    try:
        _write(model, tmp)
        try:
            os.replace(tmp, folder)
        except OSError:  # another process wrote it first
            if not (folder / MARKER).is_file():
                raise
    except GGUFError:
        raise
    except Exception as e:
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise GGUFError(
            f"{model.files[0]}: its config or tokenizer could not be read from the metadata ({type(e).__name__}: {why})"
        ) from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("GGUF %s: config and tokenizer derived into %s in %.1f s", model.name, folder, time.monotonic() - started)
    return folder


def resolve_gguf(model: str | Path) -> tuple[Path, str] | None:
    """(the derived folder, the default served name) when `model` names a GGUF file or a folder of one."""
    file = gguf_file_of(model)
    if file is None:
        return None
    opened = open_model(file)
    return derived_folder(opened), opened.name
