"""A LoRA adapter folder as PEFT writes it, read and checked without torch (the API server reads it too).

`adapter_config.json` (r, lora_alpha, target_modules, use_rslora, rank_pattern / alpha_pattern) and
`adapter_model.safetensors` (keys `base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`). Only the
safetensors header is parsed here (its JSON lists every tensor's dtype, shape and byte range), so a truncated
file, a missing weight or a shape that does not fit the base is refused before any tensor is read. The digest
(sha256 of both files) names the adapter's content: the prefix cache keys on it (engine/core/block_manager.py).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# the decoder's projections an adapter may target -> the fused projection holding them ("qkv", "o", "gate_up",
# "down"); Phi-3's checkpoints fuse q|k|v and gate|up themselves, and its adapters target the fused names
TARGETS: dict[str, str] = {
    "q_proj": "qkv",
    "k_proj": "qkv",
    "v_proj": "qkv",
    "qkv_proj": "qkv",
    "o_proj": "o",
    "gate_proj": "gate_up",
    "up_proj": "gate_up",
    "gate_up_proj": "gate_up",
    "down_proj": "down",
}
# the module holding each target in PEFT's keys (`...layers.N.self_attn.q_proj...`)
PARENT = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "qkv_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "gate_up_proj": "mlp",
    "down_proj": "mlp",
}
_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
_DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}
_MAX_HEADER = 100 << 20  # safetensors' own cap on the header's JSON


class AdapterError(ValueError):
    """An adapter that cannot be served here; the message says why (the API answers 400 with it)."""


@dataclass(frozen=True)
class BaseDims:
    """The base model's projection sizes: member name -> (in_features, out_features); and its layer count."""

    num_layers: int
    members: dict[str, tuple[int, int]]

    @classmethod
    def of(cls, num_layers: int, hidden: int, q_size: int, kv_size: int, intermediate: int | None) -> BaseDims:
        """intermediate None: a MoE model, whose MLP projections take no adapter."""
        members = {
            "q_proj": (hidden, q_size),
            "k_proj": (hidden, kv_size),
            "v_proj": (hidden, kv_size),
            "qkv_proj": (hidden, q_size + 2 * kv_size),
            "o_proj": (q_size, hidden),
        }
        if intermediate is not None:
            members |= {
                "gate_proj": (hidden, intermediate),
                "up_proj": (hidden, intermediate),
                "gate_up_proj": (hidden, 2 * intermediate),
                "down_proj": (intermediate, hidden),
            }
        return cls(num_layers, members)

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> BaseDims:
        """From a checkpoint's config.json (a vision checkpoint nests the text model's in text_config)."""
        text = cfg.get("text_config") or cfg
        hidden, heads = int(text["hidden_size"]), int(text["num_attention_heads"])
        head_dim = int(text.get("head_dim") or hidden // heads)
        kv = int(text.get("num_key_value_heads") or heads)
        moe = any(text.get(k) for k in ("num_experts", "num_local_experts"))
        inter = None if moe else int(text["intermediate_size"])
        return cls.of(int(text["num_hidden_layers"]), hidden, heads * head_dim, kv * head_dim, inter)


@dataclass(frozen=True)
class ModuleSpec:
    """One targeted projection of one layer: its tensors' keys, rank and scaling."""

    layer: int
    name: str  # q_proj, ..., down_proj (TARGETS' keys)
    rank: int
    scaling: float  # alpha / r, or alpha / sqrt(r) with use_rslora
    a_key: str
    b_key: str


@dataclass(frozen=True)
class AdapterSpec:
    path: str
    rank: int  # the largest of its modules'
    modules: tuple[ModuleSpec, ...]
    digest: str  # sha256 of adapter_config.json and the weights file: the adapter's content


def _refuse_unsupported(cfg: dict[str, Any]) -> None:
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"peft_type {cfg.get('peft_type')!r} is not LoRA")
    if cfg.get("use_dora"):
        raise AdapterError("DoRA adapters (use_dora) are not supported")
    if cfg.get("bias", "none") != "none":
        raise AdapterError(f"bias {cfg.get('bias')!r} is not supported; only adapters with bias 'none'")
    if cfg.get("modules_to_save"):
        raise AdapterError(f"modules_to_save {cfg['modules_to_save']!r} is not supported")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(set(targets) - set(TARGETS))
        if unknown:
            raise AdapterError(f"unknown target modules {unknown}; supported: {', '.join(TARGETS)}")
    elif not isinstance(targets, str):
        raise AdapterError("adapter_config.json has no target_modules")
    if not isinstance(cfg.get("r"), int) or cfg["r"] < 1:
        raise AdapterError(f"r must be a positive integer, got {cfg.get('r')!r}")


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern: the first key that names the module's full name or its tail."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?{key}$", module):
            return value
    return default


def read_header(path: Path) -> dict[str, Any]:
    """The safetensors header (tensor name -> dtype, shape, data_offsets), checked against the file's size."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise AdapterError(f"{path.name} is truncated (no header)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise AdapterError(f"{path.name} is truncated or not a safetensors file")
            header = json.loads(f.read(n))
    except OSError as e:
        raise AdapterError(f"cannot read {path}: {e.strerror}") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise AdapterError(f"{path.name} is not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise AdapterError(f"{path.name} is not a safetensors file")
    header.pop("__metadata__", None)
    for name, info in header.items():
        start, end = info["data_offsets"]
        if info.get("dtype") not in _DTYPE_BYTES:
            raise AdapterError(f"{name}: dtype {info.get('dtype')!r} is not a float type")
        if end - start != math.prod(info["shape"]) * _DTYPE_BYTES[info["dtype"]] or 8 + n + end > size:
            raise AdapterError(f"{path.name} is truncated: {name} lies past the end of the file")
    return header


def digest(folder: Path) -> str:
    h = hashlib.sha256()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        h.update(name.encode())
        with (folder / name).open("rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()


def read_adapter(path: str, base: BaseDims, max_rank: int) -> AdapterSpec:
    """Every check of an adapter folder that needs no tensor: AdapterError names the first that fails."""
    folder = Path(path)
    if not folder.is_dir():
        raise AdapterError(f"no adapter folder at {path!r}")
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (folder / name).is_file():
            raise AdapterError(f"{path!r} has no {name}")
    try:
        cfg = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, ValueError) as e:
        raise AdapterError(f"{CONFIG_FILE} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"{CONFIG_FILE} should hold a JSON object")
    _refuse_unsupported(cfg)
    modules = _modules(cfg, read_header(folder / WEIGHTS_FILE), base, max_rank)
    return AdapterSpec(str(folder), max(m.rank for m in modules), modules, digest(folder))


def _modules(cfg: dict[str, Any], header: dict[str, Any], base: BaseDims, max_rank: int) -> tuple[ModuleSpec, ...]:
    found: dict[tuple[int, str], dict[str, str]] = {}
    for key in header:
        m = _KEY.fullmatch(key)
        if m is None or m.group(3) not in TARGETS or PARENT[m.group(3)] != m.group(2):
            raise AdapterError(f"unknown target module in weights: {key}")
        found.setdefault((int(m.group(1)), m.group(3)), {})[m.group(4)] = key
    if not found:
        raise AdapterError(f"{WEIGHTS_FILE} holds no LoRA weights")
    specs = []
    for (layer, name), keys in sorted(found.items()):
        specs.append(_module(cfg, header, base, max_rank, layer, name, keys))
    return tuple(specs)


def _module(
    cfg: dict[str, Any],
    header: dict[str, Any],
    base: BaseDims,
    max_rank: int,
    layer: int,
    name: str,
    keys: dict[str, str],
) -> ModuleSpec:
    full = f"model.layers.{layer}.{PARENT[name]}.{name}"
    if set(keys) != {"A", "B"}:
        raise AdapterError(f"missing weights: {full} has lora_{'B' if 'A' in keys else 'A'} but not the other")
    if layer >= base.num_layers:
        raise AdapterError(f"{full}: the base model has only {base.num_layers} layers")
    if name not in base.members:
        raise AdapterError(f"{full}: the base model has no {name} to adapt (a MoE model takes attention adapters)")
    rank = int(_pattern_value(cfg.get("rank_pattern") or {}, full, cfg["r"]))
    if rank > max_rank:
        raise AdapterError(
            f"rank {rank} ({full}) is above --max-lora-rank {max_rank}; start the server with "
            f"--max-lora-rank {rank} or more"
        )
    d_in, d_out = base.members[name]
    a_shape, b_shape = header[keys["A"]]["shape"], header[keys["B"]]["shape"]
    if a_shape != [rank, d_in] or b_shape != [d_out, rank]:
        raise AdapterError(
            f"{full}: lora_A {a_shape} and lora_B {b_shape} do not fit the base (expected "
            f"[{rank}, {d_in}] and [{d_out}, {rank}])"
        )
    alpha = float(_pattern_value(cfg.get("alpha_pattern") or {}, full, cfg.get("lora_alpha", 8)))
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    return ModuleSpec(layer, name, rank, scaling, keys["A"], keys["B"])
