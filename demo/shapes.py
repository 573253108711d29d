"""Random-weight checkpoints of real models' exact shapes, for benchmarks: `spindle make-demo --shape NAME PATH`
(the hybrids' shapes: demo/hybrid_shapes.py).

Tensors are drawn straight into safetensors shards (no transformers model is built), so the ~1 GB of
Qwen2.5-0.5B takes seconds; the config.json is the real model's, so transformers loads the folder too.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from demo.hybrid_shapes import HYBRID_GENERATION, HYBRID_SHAPES, hybrid_tensor_shapes

# config.json of the real checkpoints (Qwen2.5-0.5B-Instruct, Qwen2.5-1.5B-Instruct, Llama-3.2-1B-Instruct), less
# their transformers version
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_act": "silu",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "max_window_layers": 21,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "use_sliding_window": False,
        "tie_word_embeddings": True,
        "vocab_size": 151936,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "torch_dtype": "bfloat16",
        "use_cache": True,
    },
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "vocab_size": 128256,
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "torch_dtype": "bfloat16",
        "use_cache": True,
    },
    **HYBRID_SHAPES,
}
_GENERATION = {
    "qwen2": {
        "bos_token_id": 151643,
        "pad_token_id": 151643,
        "eos_token_id": [151645, 151643],
        "do_sample": True,
        "temperature": 0.7,
        "top_p": 0.8,
        "top_k": 20,
        "repetition_penalty": 1.05,
    },
    "llama": {
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
        "do_sample": True,
        "temperature": 0.6,
        "top_p": 0.9,
    },
    **HYBRID_GENERATION,
}
# the tokenizer each family's checkpoint gets (None: token ids only; LFM2's 65,536 ids hold none of ours)
_TOKENIZER: dict[str, str | None] = {"qwen2": "qwen2.5", "qwen3_5_text": "qwen2.5", "llama": "llama3", "lfm2": None}
SHARD_BYTES = 1 << 30

# Qwen2.5-1.5B-Instruct's config.json is 0.5B's with these sizes
SHAPES["qwen2.5-1.5b"] = {
    **SHAPES["qwen2.5-0.5b"],
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
}


def tensor_shapes(cfg: dict[str, Any]) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every tensor a Hugging Face checkpoint of this config holds, in file order."""
    if cfg["model_type"] in HYBRID_GENERATION:
        yield from hybrid_tensor_shapes(cfg)
        return
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // heads
    bias = cfg["model_type"] == "qwen2" or bool(cfg.get("attention_bias"))
    yield "model.embed_tokens.weight", (vocab, h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (h,)
        for name, rows in (("q_proj", heads * d), ("k_proj", kv * d), ("v_proj", kv * d)):
            yield p + f"self_attn.{name}.weight", (rows, h)
            if bias:
                yield p + f"self_attn.{name}.bias", (rows,)
        yield p + "self_attn.o_proj.weight", (h, heads * d)
        yield p + "post_attention_layernorm.weight", (h,)
        yield p + "mlp.gate_proj.weight", (inter, h)
        yield p + "mlp.up_proj.weight", (inter, h)
        yield p + "mlp.down_proj.weight", (h, inter)
    yield "model.norm.weight", (h,)
    if not cfg["tie_word_embeddings"]:
        yield "lm_head.weight", (vocab, h)


def _draw(name: str, shape: tuple[int, ...], hidden: int, g: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """As random_checkpoint's _reinit: activations keep unit size and logits spread (std ~2.5)."""
    x = torch.randn(shape, generator=g)
    if "embed_tokens" in name or "lm_head" in name:
        x *= 2.5 / math.sqrt(hidden)
    elif "norm" in name:
        x = x.mul_(0.1).add_(1.0)
    elif name.endswith("bias"):
        x *= 0.1
    else:  # fan-in: the last dim (a depthwise conv1d weight [C, 1, K] too)
        x *= 1 / math.sqrt(shape[-1])
    return x.to(dtype)


def _write_weights(folder: Path, cfg: dict[str, Any], seed: int, dtype: torch.dtype) -> None:
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, shape in tensor_shapes(cfg):
        nbytes = math.prod(shape) * dtype.itemsize
        if size and size + nbytes > SHARD_BYTES:
            save_file(shards[-1], str(folder / f"part-{len(shards)}.safetensors"), metadata={"format": "pt"})
            shards[-1] = {n: torch.empty(0) for n in shards[-1]}  # names kept for the index, memory freed
            shards.append({})
            size = 0
        shards[-1][name] = _draw(name, shape, cfg["hidden_size"], g, dtype)
        size += nbytes
    save_file(shards[-1], str(folder / f"part-{len(shards)}.safetensors"), metadata={"format": "pt"})
    count = len(shards)
    files = {
        i: f"model-{i:05d}-of-{count:05d}.safetensors" if count > 1 else "model.safetensors"
        for i in range(1, count + 1)
    }
    for i, f in files.items():
        os.rename(folder / f"part-{i}.safetensors", folder / f)
    if count > 1:
        weight_map = {n: files[i + 1] for i, shard in enumerate(shards) for n in shard}
        total = sum(math.prod(s) * dtype.itemsize for _, s in tensor_shapes(cfg))
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def write_shaped_checkpoint(
    path: str | Path, shape: str | dict[str, Any], *, seed: int = 0, dtype: str = "bfloat16", tokenizer: bool = True
) -> Path:
    """A random-weight checkpoint at `path` (must not exist), atomically. shape: a name in SHAPES or a config
    dict (tests pass scaled-down ones). The tokenizer: Qwen2.5's real one (Qwen2.5, Qwen3.5), for Llama 3
    cl100k_base with Llama 3's special tokens (demo/llama3_tokenizer.py), none for LFM2."""
    cfg = dict(SHAPES[shape]) if isinstance(shape, str) else dict(shape)
    cfg["torch_dtype"] = dtype
    path = Path(path)
    if path.exists():
        raise FileExistsError(f"{path} already exists; pick a new folder or delete it first")
    family = cfg["model_type"]
    if family not in _GENERATION:
        raise ValueError(f"model_type {family!r} has no demo shape; use one of {', '.join(_GENERATION)}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        (tmp / "generation_config.json").write_text(json.dumps(_GENERATION[family], indent=2))
        _write_weights(tmp, cfg, seed, getattr(torch, dtype))
        if tokenizer and _TOKENIZER[family] == "qwen2.5":
            from demo.tokenizers import write_tokenizer

            write_tokenizer("qwen2.5", tmp)
        elif tokenizer and _TOKENIZER[family] == "llama3":
            from demo import llama3_tokenizer

            llama3_tokenizer.write(tmp)
        os.rename(tmp, path)  # atomic: readers see no folder or a whole checkpoint
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m demo.shapes")
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--layers", type=int, default=None, help="fewer decoder layers (quick checks)")
    ap.add_argument("--no-tokenizer", action="store_true", help="weights and config only (token-id benchmarks)")
    ap.add_argument("path")
    args = ap.parse_args(argv)
    shape = dict(SHAPES[args.shape])
    if args.layers is not None:
        shape["num_hidden_layers"] = args.layers
    print(write_shaped_checkpoint(args.path, shape, dtype=args.dtype, tokenizer=not args.no_tokenizer))


if __name__ == "__main__":
    main()
