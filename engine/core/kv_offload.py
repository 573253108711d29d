"""KV blocks to and from the disk store (engine/core/kv_disk_store.py): what names a block on disk, and its bytes.

A block's disk key is `<model digest>:<dtype>:<block size>:<layout>:<prefix hash>`: the model digest names the
checkpoint (its weight and config files' paths, sizes and mtimes) and the quantization, the layout every layer's
(kv heads, head dim), and the prefix hash chains the whole prefix and every key that changes KV (adapter, images:
`block_manager.block_hash`). The payload is each layer's K then V block, in layer order, as raw bytes.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch

from engine.cache_root import cache_root
from engine.core.kv_disk_store import KVDiskStore
from engine.gguf.folder import gguf_files

_WEIGHTS = ("*.safetensors", "*.bin", "*.gguf", "*.pt", "config.json")


DISK_SHARE = 10  # the store takes at most a tenth of the free space it finds (with what it already holds)


def fitted_bound(folder: Path, asked: int) -> int:
    """--kv-disk-cache-size fitted to the disk: never more than a tenth of the free space plus the store's own files."""
    folder.mkdir(parents=True, exist_ok=True)
    held = sum(p.stat().st_size for p in folder.glob("*.kvb") if p.is_file())
    return min(asked, (shutil.disk_usage(folder).free + held) // DISK_SHARE)


def model_digest(folder: Path, quantization: str | None) -> str:
    """The checkpoint's identity, as the GGUF derivation keys its files: paths, sizes and mtimes of what loads."""
    files = sorted({p for pattern in _WEIGHTS for p in folder.glob(pattern) if p.is_file()})
    files += gguf_files(folder) or []  # a folder derived from GGUF files: the files themselves name the weights
    stats = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    return hashlib.sha256(json.dumps([stats, quantization]).encode()).hexdigest()[:24]


def default_folder() -> Path:
    return cache_root() / "kv_blocks"


class KVOffload:
    """Copies blocks of a runner's KV caches out to the store and back in, under one model's key prefix."""

    def __init__(self, store: KVDiskStore, caches: list[tuple[torch.Tensor, torch.Tensor]], model: str) -> None:
        self.store = store
        self.caches = caches
        k0 = caches[0][0]
        layout = ",".join(f"{k.shape[2]}x{k.shape[3]}" for k, _ in caches)
        self.prefix = f"{model}:{k0.dtype}:{k0.shape[1]}:{len(caches)}L[{layout}]:"
        self.block_bytes = sum(2 * k[0].numel() * k.element_size() for k, _ in caches)
        self.loaded = 0  # blocks read back (cumulative)

    def key(self, block_hash: str) -> str:
        return self.prefix + block_hash

    def has(self, block_hash: str) -> bool:
        return self.key(block_hash) in self.store

    def save(self, block: int, block_hash: str) -> None:
        """Queue block's KV for writing (copied now: the block may be reused at once); dropped on a full queue."""
        key = self.key(block_hash)
        if not self.store.can_take() or key in self.store:
            return
        parts = [t[block].contiguous().reshape(-1).view(torch.uint8) for kv in self.caches for t in kv]
        self.store.put(key, torch.cat(parts).cpu().numpy().tobytes())

    def load(self, block: int, block_hash: str) -> bool:
        """Fill block from the store; False (block untouched) when it is missing or its file is damaged."""
        payload = self.store.get(self.key(block_hash), self.block_bytes)
        if payload is None:
            return False
        flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        at = 0
        for kv in self.caches:
            for t in kv:
                dst = t[block]
                n = dst.numel() * dst.element_size()
                dst.copy_(flat[at : at + n].view(dst.dtype).view(dst.shape))
                at += n
        self.loaded += 1
        return True
