"""Find a checkpoint folder and load it: config.json, safetensors weights, generation_config.json.

Weights are read with safetensors directly (no transformers model class), tensor by tensor, so
loading needs little more memory than the model itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from engine.config import EngineEnv
from engine.gguf.folder import gguf_files, resolve_gguf
from engine.gguf.header import GGUFError
from engine.models.args import ConfigError, ModelArgs
from engine.models.auto_dtype import auto_dtype

# config.json / generation_config.json reading is torch-free, shared with the render-only server; the error
# and read_config stay importable from here, as the engine's modules do
from engine.models.checkpoint_meta import ModelLoadError as ModelLoadError
from engine.models.checkpoint_meta import eos_token_ids, generation_defaults, read_generation_config
from engine.models.checkpoint_meta import read_config as read_config
from engine.models.checkpoint_meta import tokenizer_token_count as tokenizer_token_count
from engine.models.decoder import CausalLM, Checkpoint
from engine.models.gguf_weights import GGUFWeights
from engine.models.pooling_archs import as_decoder_config, decoder_weights
from engine.models.registry import family_of, parse_config
from engine.models.weights import Weights

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_HUB_PATTERNS = ["*.safetensors", "*.json", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"]


class ModelShard(Protocol):
    """One tensor-parallel rank's part of the model (engine/distributed/sharding.py `Shard`)."""

    def weights(self, folder: Path, args: ModelArgs, dtype: torch.dtype, device: torch.device) -> Weights:
        """This rank's slices of the checkpoint's tensors."""
        ...

    def build(
        self, args: ModelArgs, weights: Weights, has_lm_head: bool, max_positions: int, quantization: str | None = None
    ) -> CausalLM:
        """The decoder on those slices."""
        ...


@dataclass(frozen=True)
class ModelInfo:
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: list[int]
    generation_defaults: dict[str, float | int] = field(default_factory=dict)
    dtype: str = "float32"
    num_layers: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0


def resolve_model(model: str) -> Path:
    """A local folder as is; otherwise a Hugging Face hub id, downloaded (or found in the HF cache)."""
    path = Path(model).expanduser()
    try:
        gguf = resolve_gguf(path)  # a .gguf file or a folder of one: its derived HF-shaped folder
    except GGUFError as e:
        raise ModelLoadError(str(e)) from e
    if gguf is not None:
        return gguf[0]
    if path.is_dir():
        return path
    if model.startswith(("/", ".", "~")) or model.count("/") > 1:  # a path, not an "org/name" hub id
        raise ModelLoadError(f"--model {model!r}: no such folder; pass an existing checkpoint folder or a hub id")
    from huggingface_hub import snapshot_download  # why late: only hub ids need it

    try:
        return Path(snapshot_download(repo_id=model, allow_patterns=_HUB_PATTERNS))
    except Exception as e:  # noqa: BLE001 - any hub failure means the same thing to the user
        why = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ModelLoadError(
            f"--model {model!r} is not a local folder and could not be downloaded from the Hugging Face "
            f"hub ({type(e).__name__}: {why}); pass the path of a local checkpoint folder instead"
        ) from e


def pick_dtype(
    requested: str, checkpoint_dtype: str | None, device: torch.device, packed_gguf: list[Path] | None = None
) -> str:
    """--dtype as given, or for auto the fastest path here (engine/models/auto_dtype.py). packed_gguf: the files of
    a GGUF model whose blocks stay packed on CPU."""
    if requested != "auto":
        if requested not in _DTYPES:
            raise ModelLoadError(f"dtype {requested!r} is not supported; use one of auto, {', '.join(_DTYPES)}")
        return requested
    return auto_dtype(checkpoint_dtype, device, packed_gguf)


def slow_half_precision(dtype: str, device: torch.device) -> str | None:
    """Why `dtype` will be slow on this CPU (no native bfloat16/float16 matmul), or None."""
    if device.type != "cpu" or dtype not in ("bfloat16", "float16"):
        return None
    cpu = torch.cpu
    if dtype == "bfloat16":
        native = (
            getattr(cpu, "_is_avx512_bf16_supported", lambda: True)()
            or getattr(cpu, "_is_amx_tile_supported", lambda: True)()
        )
    else:
        native = getattr(cpu, "_is_amx_fp16_supported", lambda: True)()
    if native:
        return None
    return (
        f"this CPU has no native {dtype} matrix multiply (AVX512-BF16 / AMX), so torch emulates it and "
        f"--dtype {dtype} runs several times slower than float32 here; pass --dtype float32 (or auto)"
    )


def keep_gguf_blocks(device: torch.device, quantization: str | None) -> bool:
    """Whether a GGUF model's quantized weights stay the file's blocks (CPU, no --quantization, the quantized
    kernels present, SPINDLE_GGUF_DEQUANTIZE unset or 0); otherwise they are dequantized at load."""
    if device.type != "cpu" or quantization is not None or EngineEnv.read().gguf_dequantize:
        return False
    try:
        import engine.layers.quant_linear  # noqa: F401 - registers make_linear's maker for blocks
        from engine.cpu_kernels import quant_gemm
    except ImportError:
        return False
    return quant_gemm.available()  # without the kernel library every product would dequantize in Python


def load_model(
    path: str | Path,
    dtype: str,
    device: torch.device | str,
    max_positions: int | None = None,
    shard: ModelShard | None = None,
    quantization: str | None = None,
) -> tuple[CausalLM, ModelInfo]:
    """Build the model from a checkpoint folder. max_positions sizes the rotary table (default: the config's).

    shard: this tensor-parallel rank's part only (engine/distributed/sharding.py); info then counts its KV heads.
    quantization: "int8" packs every projection and the LM head as weight-only int8 (engine/layers/linear.py).
    """
    folder, device = Path(path), torch.device(device)
    cfg = as_decoder_config(read_config(folder))  # a pooling-only checkpoint: its decoder
    try:
        arch, family = family_of(cfg)
        args = parse_config(cfg)
    except ConfigError as e:
        raise ModelLoadError(f"{folder / 'config.json'}: {e}") from e
    ggufs = _gguf_files_if_runnable(folder, arch, family.tensor_parallel, device, shard, quantization)
    packed = ggufs is not None and keep_gguf_blocks(device, quantization)
    dtype_name = pick_dtype(dtype, cfg.get("torch_dtype") or cfg.get("dtype"), device, ggufs if packed else None)
    positions = max_positions or args.max_position_embeddings
    num_kv_heads = args.num_kv_heads
    weights: Weights
    with torch.inference_mode():
        if ggufs is not None:
            weights = from_file = GGUFWeights(ggufs, _DTYPES[dtype_name], device, keep_quantized=packed)
            model = family.model.load(
                Checkpoint(cfg, args, weights, "lm_head.weight" in weights, positions, quantization)
            )
            from_file.log_held()
        elif shard is None:
            weights = Weights(folder, _DTYPES[dtype_name], device)
            source = decoder_weights(weights)
            model = family.model.load(
                Checkpoint(cfg, args, source, "lm_head.weight" in weights, positions, quantization)
            )
        else:
            weights = shard.weights(folder, args, _DTYPES[dtype_name], device)
            model = shard.build(args, weights, "lm_head.weight" in weights, positions, quantization)
            num_kv_heads = model.args.num_kv_heads  # this rank's own (maybe replicated) KV heads
    weights.progress.close()
    return model, _model_info(folder, cfg, args, dtype_name, num_kv_heads)


def _gguf_files_if_runnable(
    folder: Path,
    arch: str,
    tensor_parallel: bool,
    device: torch.device,
    shard: ModelShard | None,
    quantization: str | None,
) -> list[Path] | None:
    """The folder's GGUF files (None: none), once the placement asked for is known to run here (else a
    ModelLoadError saying which flag to change)."""
    if shard is not None and not tensor_parallel:
        raise ModelLoadError(f"{arch} checkpoints do not run tensor parallel here; pass --tensor-parallel-size 1")
    if quantization is not None and device.type != "cpu":
        raise ModelLoadError(f"--quantization {quantization} runs on CPU only here; drop it or pass --device cpu")
    ggufs = gguf_files(folder)
    if ggufs is not None and shard is not None:
        raise ModelLoadError("a GGUF model does not run tensor parallel here; pass --tensor-parallel-size 1")
    return ggufs


def _model_info(folder: Path, cfg: dict[str, Any], args: ModelArgs, dtype_name: str, num_kv_heads: int) -> ModelInfo:
    """What the engine needs to know of the loaded model; `num_kv_heads`: this rank's own."""
    gen = read_generation_config(folder)
    eos, defaults = eos_token_ids(cfg, gen), generation_defaults(gen)
    tokens = tokenizer_token_count(folder)
    return ModelInfo(
        vocab_size=min(args.vocab_size, tokens) if tokens else args.vocab_size,
        max_position_embeddings=args.max_position_embeddings,
        eos_token_ids=eos,
        generation_defaults=defaults,
        dtype=dtype_name,
        num_layers=args.num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=args.head_dim,
    )
