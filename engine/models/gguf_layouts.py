"""What llama.cpp's converter did to Qwen3.5 (`qwen35`), Granite 4.0-H (`granitehybrid`) and Gemma 4 (`gemma4`)
weights, as recipes that turn a Hugging Face weight name back into the GGUF tensor(s) it came from.

Undone here (convert_hf_to_gguf.py's Qwen3NextModel / _LinearAttentionVReorderBase, Mamba2Model / GraniteHybridModel,
Gemma4Model): Qwen3.5's norms stored +1, its DeltaNet value heads reordered from grouped to tiled (rows of
in_proj_qkv's V part, in_proj_z, in_proj_a / b, the convolution's V channels, A and dt_bias; columns of out_proj),
A stored as -exp(A_log) (also Granite's), Granite's Q/K rows permuted for llama's rotary layout, its fused
gate|up split in two (experts: per expert), its Mamba A / D / norm reshaped, Gemma 4's layer_scalar named
layer_output_scale.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    import gguf


def rotary_rows(rows: int, heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's Q/K permutation: HF row (h, j, d) is GGUF row (h, d, j)."""
    return torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)


def _grouped(k_heads: int, per_k: int, head_dim: int) -> torch.Tensor:
    """The order that undoes _reorder_v_heads: HF (grouped) index (k, r, d) is GGUF (tiled) index (r, k, d)."""
    n = k_heads * per_k * head_dim
    return torch.arange(n).reshape(per_k, k_heads, head_dim).permute(1, 0, 2).reshape(-1)


def _log_neg(a: torch.Tensor) -> torch.Tensor:
    return torch.log(-a)  # A_log from the stored A = -exp(A_log)


def _minus_one(w: torch.Tensor) -> torch.Tensor:
    return w - 1  # a norm weight stored with Qwen3.5's (1 + w) folded in


@dataclass(frozen=True)
class Recipe:
    """How one HF weight comes back from the file."""

    parts: tuple[str, ...]  # GGUF tensors; several are concatenated along `dim`
    dim: int = 0  # 0: rows; 1: per expert ([experts, rows, in] stacked tensors)
    rows: torch.Tensor | None = None  # HF row j is row rows[j] of the (concatenated) tensor
    cols: torch.Tensor | None = None  # HF column j is column cols[j] (dequantized)
    value: Callable[[torch.Tensor], torch.Tensor] | None = None  # an elementwise undo (dequantized)
    shape: tuple[int, ...] | None = None
    keep: bool = True  # may stay the file's blocks (a projection, the embedding or the head)


Layout = Callable[[str], Recipe | None]
_SUFFIXES = (".weight", ".bias")


def _name_map(arch: str, blocks: int) -> gguf.TensorNameMap:
    import gguf  # why late: gguf imports mistral_common (+0.5 s); only a GGUF model needs it

    return gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), blocks)


def _qwen35(meta: dict[str, Any], names: gguf.TensorNameMap) -> Layout:
    k_heads, v_heads = int(meta["qwen35.ssm.group_count"]), int(meta["qwen35.ssm.time_step_rank"])
    k_dim, v_dim = int(meta["qwen35.ssm.state_size"]), int(meta["qwen35.ssm.inner_size"]) // v_heads
    per_k = v_heads // k_heads
    qk = 2 * k_heads * k_dim
    v_rows, heads = _grouped(k_heads, per_k, v_dim), _grouped(k_heads, per_k, 1)
    qkv_rows = torch.cat([torch.arange(qk), qk + v_rows])
    reorder: dict[str, dict[str, Any]] = {
        "in_proj_qkv.weight": {"rows": qkv_rows},
        "in_proj_z.weight": {"rows": v_rows},
        "in_proj_a.weight": {"rows": heads},
        "in_proj_b.weight": {"rows": heads},
        "conv1d.weight": {"rows": qkv_rows, "keep": False},
        "A_log": {"rows": heads, "value": _log_neg, "keep": False},
        "dt_bias": {"rows": heads, "keep": False},
        "out_proj.weight": {"cols": v_rows, "keep": False},
    }

    def recipe(name: str) -> Recipe | None:
        gguf_name = names.get_name(name.replace(".dt_bias", ".dt_proj.bias"), try_suffixes=_SUFFIXES)
        if gguf_name is None:
            return None
        if ".linear_attn." in name:
            undo = reorder.get(name.rpartition(".linear_attn.")[2], {}) if per_k > 1 else {}
            keep = name.endswith(("_qkv.weight", "_z.weight", "_a.weight", "_b.weight", "out_proj.weight"))
            return Recipe((gguf_name,), **({"keep": keep} | undo))
        if name.endswith("norm.weight"):
            return Recipe((gguf_name,), value=_minus_one, keep=False)
        # q_proj holds q|gate per head, split in the model on a dense tensor, and k, v are fused with q
        return Recipe((gguf_name,), keep=not name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")))

    return recipe


def _granite_mlp(name: str, experts: bool, block: str) -> Recipe | None:
    """Granite's fused gate|up (shared MLP, or per expert) and its down projection, as llama.cpp split them."""
    shared = "_shexp" if experts else ""
    if name.endswith("shared_mlp.input_linear.weight"):
        return Recipe((f"{block}.ffn_gate{shared}.weight", f"{block}.ffn_up{shared}.weight"))
    if name.endswith("shared_mlp.output_linear.weight"):
        return Recipe((f"{block}.ffn_down{shared}.weight",))
    if name.endswith("block_sparse_moe.input_linear.weight"):
        return Recipe((f"{block}.ffn_gate_exps.weight", f"{block}.ffn_up_exps.weight"), dim=1, keep=False)
    return None


def _granitehybrid(meta: dict[str, Any], names: gguf.TensorNameMap) -> Layout:
    heads = int(meta["granitehybrid.attention.head_count"])
    kv: Any = meta["granitehybrid.attention.head_count_kv"]
    kv_heads = max(int(k) for k in kv) if hasattr(kv, "__len__") else int(kv)
    experts = bool(meta.get("granitehybrid.expert_count"))
    ssm_heads = int(meta["granitehybrid.ssm.time_step_rank"])
    inner = int(meta["granitehybrid.ssm.inner_size"])
    shapes = {"A_log": (ssm_heads,), "D": (ssm_heads,), "norm.weight": (inner,)}

    def recipe(name: str) -> Recipe | None:
        if name.startswith("model.layers."):
            block = "blk." + name.split(".")[2]
            if (mlp := _granite_mlp(name, experts, block)) is not None:
                return mlp
        gguf_name = names.get_name(name.replace(".dt_bias", ".dt_proj.bias"), try_suffixes=_SUFFIXES)
        if gguf_name is None:
            return None
        if ".mamba." in name:
            what = name.rpartition(".mamba.")[2]
            return Recipe(
                (gguf_name,),
                value=_log_neg if what == "A_log" else None,
                shape=shapes.get(what),
                keep=what.endswith("proj.weight"),
            )
        if name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
            n = heads if ".q_proj." in name else kv_heads
            rows = int(meta["granitehybrid.embedding_length"]) // heads * n
            return Recipe((gguf_name,), rows=rotary_rows(rows, n), keep=name.endswith("weight"))
        return Recipe((gguf_name,), keep=name.endswith(("proj.weight", "embed_tokens.weight", "lm_head.weight")))

    return recipe


# Gemma 4's projections (the per-layer-input ones too), embedding and head; not the per-layer embedding table
_GEMMA4_KEPT = (
    "proj.weight",
    "per_layer_input_gate.weight",
    "per_layer_projection.weight",
    "per_layer_model_projection.weight",
    "model.embed_tokens.weight",
    "lm_head.weight",
)


def _gemma4(meta: dict[str, Any], names: gguf.TensorNameMap) -> Layout:
    del meta  # Gemma 4's tensors come back as they are, under llama.cpp's names

    def recipe(name: str) -> Recipe | None:
        scalar = name.endswith(".layer_scalar")  # stored as layer_output_scale.weight
        gguf_name = names.get_name(name + ".weight" if scalar else name, try_suffixes=_SUFFIXES)
        if gguf_name is None:
            return None
        return Recipe((gguf_name,), keep=name.endswith(_GEMMA4_KEPT))

    return recipe


_LAYOUTS = {"qwen35": _qwen35, "granitehybrid": _granitehybrid, "gemma4": _gemma4}


def layout(arch: str, meta: dict[str, Any]) -> Layout | None:
    """The architecture's recipes (None: the plain name-table mapping serves it)."""
    build = _LAYOUTS.get(arch)
    if build is None:
        return None
    return build(meta, _name_map(arch, int(meta.get(f"{arch}.block_count", 0))))
