"""Qwen3.5 (`qwen35`), Granite 4.0-H (`granitehybrid`) and Gemma 4 (`gemma4`) checkpoints as llama.cpp's
convert_hf_to_gguf.py writes them (Qwen3_5TextModel, GraniteHybridModel, Gemma4Model), followed literally: the
metadata keys each class (and its parents) adds, the tensors each modify_tensors yields, and the inverse that
takes what the file holds back to Hugging Face's layout (checked against the checkpoint, so a wrong inverse fails
here rather than agreeing with a wrong loader)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gguf
import numpy as np
import torch

Tensors = dict[str, np.ndarray]
KINDS = ("qwen3_5_text", "granitemoehybrid", "gemma4_text")  # HF model_type


def _names(arch: str, blocks: int) -> gguf.TensorNameMap:
    return gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch], blocks)


def _map(names: gguf.TensorNameMap, name: str) -> str:
    mapped = names.get_name(name, try_suffixes=(".weight", ".bias"))
    assert mapped is not None, name
    return mapped


def _base_metadata(w: gguf.GGUFWriter, cfg: dict[str, Any], ffn: Any = None) -> None:
    """TextModel.set_gguf_parameters, for the keys these checkpoints have."""
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(ffn if ffn is not None else cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    rope = cfg.get("rope_parameters") or {}
    w.add_rope_freq_base(float(rope.get("full_attention", rope)["rope_theta"]))
    if (local := rope.get("sliding_attention", {}).get("rope_theta")) is not None:
        w.add_rope_freq_base_swa(float(local))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if cfg.get("num_local_experts"):
        w.add_expert_count(cfg["num_local_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    if cfg.get("head_dim") is not None:
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])


# --- Qwen3.5: Qwen3NextModel + _LinearAttentionVReorderBase + _Qwen35MRopeMixin ---


def _qwen35_metadata(w: gguf.GGUFWriter, cfg: dict[str, Any]) -> None:
    _base_metadata(w, cfg)
    w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
    w.add_ssm_state_size(cfg["linear_key_head_dim"])
    w.add_ssm_group_count(cfg["linear_num_key_heads"])
    w.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
    w.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
    # add_recurrent_layers (gguf-py's Keys.Attention.RECURRENT_LAYERS, newer than the installed gguf package)
    w.add_array(f"{w.arch}.attention.recurrent_layers", [t == "linear_attention" for t in cfg["layer_types"]])
    w.add_full_attention_interval(cfg.get("full_attention_interval", 4))
    rope = cfg["rope_parameters"]
    w.add_rope_dimension_count(int(cfg["head_dim"] * rope.get("partial_rotary_factor", 0.25)))
    w.add_rope_dimension_sections([11, 11, 10, 0])  # no mrope_section in rope_parameters: the mixin's default


def _reorder_v_heads(t: torch.Tensor, dim: int, k_heads: int, per_k: int, head_dim: int) -> torch.Tensor:
    shape = list(t.shape)
    dim = dim + len(shape) if dim < 0 else dim
    new_shape = shape[:dim] + [k_heads, per_k, head_dim] + shape[dim + 1 :]
    perm = list(range(len(new_shape)))
    perm[dim], perm[dim + 1] = perm[dim + 1], perm[dim]
    return t.reshape(*new_shape).permute(*perm).contiguous().reshape(*shape)


def _qwen35_tensor(
    cfg: dict[str, Any], names: gguf.TensorNameMap, name: str, t: torch.Tensor
) -> tuple[str, torch.Tensor]:
    k_heads, v_heads = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    k_dim, v_dim, per_k = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], v_heads // k_heads
    if k_heads != v_heads and "linear_attn." in name:  # _LinearAttentionVReorderBase.modify_tensors
        if ".in_proj_qkv." in name:
            qk = 2 * k_heads * k_dim
            t = torch.cat([t[:qk], _reorder_v_heads(t[qk:], 0, k_heads, per_k, v_dim)])
        elif ".in_proj_z." in name:
            t = _reorder_v_heads(t, 0, k_heads, per_k, v_dim)
        elif ".in_proj_b." in name or ".in_proj_a." in name:
            t = _reorder_v_heads(t, 0, k_heads, per_k, 1)
        elif ".A_log" in name or ".dt_bias" in name:
            t = _reorder_v_heads(t.unsqueeze(-1), 0, k_heads, per_k, 1).squeeze(-1)
        elif ".conv1d" in name:
            data, qk = t.squeeze(), 2 * k_heads * k_dim
            t = torch.cat([data[:qk], _reorder_v_heads(data[qk:], 0, k_heads, per_k, v_dim)])
        elif ".out_proj." in name:
            t = _reorder_v_heads(t, 1, k_heads, per_k, v_dim)
    if name.endswith(".A_log"):  # Qwen3NextModel.modify_tensors
        t = -torch.exp(t)
    elif name.endswith(".dt_bias"):
        name = name.rpartition(".dt_bias")[0] + ".dt_proj.bias"
    elif "conv1d" in name:
        t = t.squeeze()
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        t = t + 1
    return _map(names, name), t


def _qwen35_back(cfg: dict[str, Any], stored: Tensors, hf: Tensors) -> Tensors:
    k_heads, v_heads = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    k_dim, v_dim, per_k = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], v_heads // k_heads

    def grouped(a: np.ndarray, dim: int, head: int) -> np.ndarray:  # tiled -> grouped
        return _reorder_v_heads(torch.from_numpy(a), dim, per_k, k_heads, head).numpy()

    out: Tensors = {}
    for name, gguf_name in _hf_names(cfg, "QWEN35", hf, {".dt_bias": ".dt_proj.bias"}).items():
        a = stored[gguf_name]
        if ".linear_attn." in name:
            qk = 2 * k_heads * k_dim
            what = name.rpartition(".linear_attn.")[2]
            if what in ("in_proj_qkv.weight", "conv1d.weight"):
                a = np.concatenate([a[:qk], grouped(a[qk:], 0, v_dim)])
            elif what == "in_proj_z.weight":
                a = grouped(a, 0, v_dim)
            elif what in ("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias"):
                a = grouped(a, 0, 1)
            elif what == "out_proj.weight":
                a = grouped(a, 1, v_dim)
            if what == "A_log":
                a = torch.log(-torch.from_numpy(a)).numpy()
        elif name.endswith("norm.weight"):
            a = (torch.from_numpy(a) - 1).numpy()
        out[name] = a
    return out


# --- Granite 4.0-H: GraniteHybridModel (Mamba2Model + GraniteMoeModel) ---


def _granite_attn_layers(cfg: dict[str, Any]) -> list[int]:
    # GraniteHybridModel.get_attn_layers reads "attention" (the released checkpoints' name; transformers 5 saves
    # "full_attention" for the same layer)
    return [i for i, t in enumerate(cfg["layer_types"]) if t in ("attention", "full_attention")]


def _granite_metadata(w: gguf.GGUFWriter, cfg: dict[str, Any]) -> None:
    _base_metadata(w, {k: v for k, v in cfg.items() if k != "head_dim"})  # GraniteModel pops head_dim
    w.add_vocab_size(cfg["vocab_size"])  # LlamaModel
    w.add_rope_dimension_count(cfg["hidden_size"] // cfg["num_attention_heads"])
    w.add_attention_scale(cfg["attention_multiplier"])  # GraniteModel
    w.add_embedding_scale(cfg["embedding_multiplier"])
    w.add_residual_scale(cfg["residual_multiplier"])
    w.add_logit_scale(cfg["logits_scaling"])
    if cfg.get("shared_intermediate_size"):  # GraniteMoeModel
        w.add_expert_shared_feed_forward_length(cfg["shared_intermediate_size"])
    d_inner = cfg["mamba_expand"] * cfg["hidden_size"]
    w.add_ssm_conv_kernel(cfg["mamba_d_conv"])
    w.add_ssm_state_size(cfg["mamba_d_state"])
    w.add_ssm_group_count(cfg["mamba_n_groups"])
    w.add_ssm_inner_size(d_inner)
    w.add_ssm_time_step_rank(cfg["mamba_n_heads"])
    attn = _granite_attn_layers(cfg)
    w.add_head_count_kv([cfg["num_key_value_heads"] if i in attn else 0 for i in range(cfg["num_hidden_layers"])])
    w.add_rope_scaling_finetuned(False)  # not Bamba, has SSM layers: no rope
    w.add_context_length(2**20)


def _granite_tensors(
    cfg: dict[str, Any], names: gguf.TensorNameMap, name: str, t: torch.Tensor
) -> list[tuple[str, torch.Tensor]]:
    bid = int(name.split(".")[2]) if name.startswith("model.layers.") else None
    block, experts = f"blk.{bid}", bool(cfg.get("num_local_experts"))
    if name.endswith("block_sparse_moe.input_linear.weight"):  # GraniteMoeModel.modify_tensors
        gate, up = torch.split(t, cfg["intermediate_size"], dim=-2)
        return [(f"{block}.ffn_gate_exps.weight", gate), (f"{block}.ffn_up_exps.weight", up)]
    if name.endswith("shared_mlp.input_linear.weight"):
        gate, up = torch.split(t, cfg["shared_intermediate_size"], dim=-2)
        shexp = "_shexp" if experts else ""
        return [(f"{block}.ffn_gate{shexp}.weight", gate), (f"{block}.ffn_up{shexp}.weight", up)]
    if not experts and name.endswith("shared_mlp.output_linear.weight"):
        return [(f"{block}.ffn_down.weight", t)]
    name = name.replace(".dt_bias", ".dt_proj.bias")  # Mamba2Model.filter_tensors
    mapped = _map(names, name)
    if bid is not None and bid not in _granite_attn_layers(cfg):  # Mamba2Model.modify_tensors
        if mapped.endswith("ssm_conv1d.weight"):
            t = t.squeeze()
        elif mapped.endswith(("ssm_a", "ssm_d")):
            t = t.reshape((*t.shape, 1))
        elif mapped.endswith("ssm_norm.weight"):
            t = t.reshape(cfg["mamba_n_groups"], -1)
        if name.endswith(".A_log"):
            t = -torch.exp(t)
    elif bid is not None:  # LlamaModel.modify_tensors: Q/K rows for llama's rotary layout
        if name.endswith("q_proj.weight"):
            t = _permute(t, cfg["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            t = _permute(t, cfg["num_key_value_heads"])
    return [(mapped, t)]


def _permute(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t.reshape(heads, 2, t.shape[0] // heads // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)


def _granite_back(cfg: dict[str, Any], stored: Tensors, hf: Tensors) -> Tensors:
    out: Tensors = {}
    experts = "_shexp" if cfg.get("num_local_experts") else ""
    for name in hf:
        block = "blk." + name.split(".")[2] if name.startswith("model.layers.") else ""
        if name.endswith("block_sparse_moe.input_linear.weight"):
            out[name] = np.concatenate(
                [stored[f"{block}.ffn_gate_exps.weight"], stored[f"{block}.ffn_up_exps.weight"]], 1
            )
        elif name.endswith("shared_mlp.input_linear.weight"):
            out[name] = np.concatenate(
                [stored[f"{block}.ffn_gate{experts}.weight"], stored[f"{block}.ffn_up{experts}.weight"]]
            )
        elif name.endswith("shared_mlp.output_linear.weight"):
            out[name] = stored[f"{block}.ffn_down{experts}.weight"]
        else:
            a = stored[
                _map(_names("GRANITE_HYBRID", cfg["num_hidden_layers"]), name.replace(".dt_bias", ".dt_proj.bias"))
            ]
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = cfg["num_attention_heads"] if "q_proj" in name else cfg["num_key_value_heads"]
                a = a.reshape(heads, a.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(a.shape)
            elif name.endswith(".A_log"):
                a = torch.log(-torch.from_numpy(a)).numpy()
            out[name] = a.reshape(hf[name].shape) if name.endswith((".A_log", ".D", "mamba.norm.weight")) else a
    return out


# --- Gemma 4: Gemma4Model (Gemma3Model, norm_shift 0) ---


def _gemma4_metadata(w: gguf.GGUFWriter, cfg: dict[str, Any]) -> None:
    types, n = cfg["layer_types"], cfg["num_hidden_layers"]
    full = next(v for k, v in sorted(cfg["per_layer_config"].items()) if types[int(k)] == "full_attention")
    shared = cfg["num_kv_shared_layers"]
    ffn = cfg["intermediate_size"]
    ffn_arr = [ffn if i < n - shared else 2 * ffn for i in range(n)] if cfg.get("use_double_wide_mlp") else None
    _base_metadata(w, cfg, ffn_arr)
    w.add_final_logit_softcapping(cfg["final_logit_softcapping"])  # Gemma3Model
    w.add_sliding_window(cfg["sliding_window"])
    w.add_shared_kv_layers(shared)  # Gemma4Model
    w.add_embedding_length_per_layer_input(cfg.get("hidden_size_per_layer_input") or 0)
    swa = [t == "sliding_attention" for t in types]
    w.add_sliding_window_pattern(swa)
    w.add_key_length(full["head_dim"])
    w.add_value_length(full["head_dim"])
    w.add_key_length_swa(cfg["head_dim"])
    w.add_value_length_swa(cfg["head_dim"])
    w.add_head_count_kv([cfg["num_key_value_heads"] if s else full["num_key_value_heads"] for s in swa])
    w.add_rope_dimension_count(full["head_dim"])
    w.add_rope_dimension_count_swa(cfg["head_dim"])


def _gemma4_extra(cfg: dict[str, Any]) -> Tensors:
    """Gemma4Model.generate_extra_tensors: the full layers' rope factors, 1 turned, 1e30 unturned."""
    types = cfg["layer_types"]
    full = next(v for k, v in sorted(cfg["per_layer_config"].items()) if types[int(k)] == "full_attention")
    turned = int(full["head_dim"] * cfg["rope_parameters"]["full_attention"]["partial_rotary_factor"] / 2)
    values = [1.0] * turned + [1e30] * (full["head_dim"] // 2 - turned)
    return {"rope_freqs.weight": np.array(values, dtype=np.float32)}


def _gemma4_tensor(names: gguf.TensorNameMap, name: str, t: torch.Tensor) -> tuple[str, torch.Tensor]:
    if name.endswith("layer_scalar"):  # Gemma4Model.filter_tensors
        name += ".weight"
    return _map(names, name), t  # the tokenizer has every embedding row: none dropped; norm_shift 0


def _hf_names(cfg: dict[str, Any], arch: str, hf: Tensors, renames: dict[str, str]) -> dict[str, str]:
    names = _names(arch, cfg["num_hidden_layers"])
    out = {}
    for name in hf:
        renamed = name
        for old, new in renames.items():
            renamed = renamed.replace(old, new)
        if name.endswith("layer_scalar"):
            renamed += ".weight"
        out[name] = _map(names, renamed)
    return out


def _gemma4_back(cfg: dict[str, Any], stored: Tensors, hf: Tensors) -> Tensors:
    return {name: stored[g] for name, g in _hf_names(cfg, "GEMMA4", hf, {}).items()}


# --- the converter per model_type ---


def convert(cfg: dict[str, Any], hf: Tensors) -> tuple[str, Callable[[gguf.GGUFWriter], None], Tensors]:
    """(the GGUF architecture, its metadata writer, GGUF name -> tensor as llama.cpp's converter writes it)."""
    kind = cfg["model_type"]
    arch = {"qwen3_5_text": "QWEN35", "granitemoehybrid": "GRANITE_HYBRID", "gemma4_text": "GEMMA4"}[kind]
    names = _names(arch, cfg["num_hidden_layers"])
    out: dict[str, torch.Tensor] = {}
    for name, value in hf.items():
        t = torch.from_numpy(value.astype(np.float32))
        if kind == "qwen3_5_text":
            pairs = [_qwen35_tensor(cfg, names, name, t)]
        elif kind == "granitemoehybrid":
            pairs = _granite_tensors(cfg, names, name, t)
        else:
            pairs = [_gemma4_tensor(names, name, t)]
        out |= dict(pairs)
    tensors = {k: v.contiguous().numpy() for k, v in out.items()}
    if kind == "gemma4_text":
        tensors |= _gemma4_extra(cfg)
    meta = {"qwen3_5_text": _qwen35_metadata, "granitemoehybrid": _granite_metadata, "gemma4_text": _gemma4_metadata}
    return gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH[arch]], lambda w: meta[kind](w, cfg), tensors


def back(cfg: dict[str, Any], stored: Tensors, hf: Tensors) -> Tensors:
    """What the file holds, by HF name in HF's layout (the weights a reference model loads)."""
    undo = {"qwen3_5_text": _qwen35_back, "granitemoehybrid": _granite_back, "gemma4_text": _gemma4_back}
    return undo[cfg["model_type"]](cfg, stored, hf)
