"""config.json from the GGUF metadata of Qwen3.5 (`qwen35`), Granite 4.0-H (`granitehybrid`) and Gemma 4 (`gemma4`).

Keys are those llama.cpp's converter writes (convert_hf_to_gguf.py's Qwen3_5TextModel, GraniteHybridModel,
Gemma4Model); what the file states only through its tensors (a KV-sharing layer's width, k = v, the proportional
rope's turned share in `rope_freqs`) is read from them. A key or tensor the engine would not serve exactly stops
the derivation with one line naming it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from engine.gguf.config_fields import common
from engine.gguf.header import GGUFError, open_mapped
from engine.gguf.source import GGUFModel

if TYPE_CHECKING:
    import numpy as np

_BLOCK = re.compile(r"^blk\.(?P<i>\d+)\.(?P<stem>.+)$")
# the tensors each architecture's model here reads, as llama.cpp names them (blk.N. stripped)
SERVED: dict[str, frozenset[str]] = {
    "qwen35": frozenset(
        "token_embd.weight output_norm.weight output.weight attn_norm.weight post_attention_norm.weight "
        "ffn_gate.weight ffn_up.weight ffn_down.weight attn_q.weight attn_k.weight attn_v.weight attn_output.weight "
        "attn_q_norm.weight attn_k_norm.weight attn_qkv.weight attn_gate.weight ssm_a ssm_conv1d.weight "
        "ssm_dt.bias ssm_norm.weight ssm_beta.weight ssm_alpha.weight ssm_out.weight".split()
    ),
    "granitehybrid": frozenset(
        "token_embd.weight output_norm.weight output.weight attn_norm.weight ffn_norm.weight ssm_in.weight "
        "ssm_conv1d.weight ssm_conv1d.bias ssm_dt.bias ssm_a ssm_d ssm_norm.weight ssm_out.weight attn_q.weight "
        "attn_k.weight attn_v.weight attn_output.weight attn_q.bias attn_k.bias attn_v.bias attn_output.bias "
        "ffn_gate_inp.weight ffn_gate_exps.weight ffn_up_exps.weight ffn_down_exps.weight ffn_gate_shexp.weight "
        "ffn_up_shexp.weight ffn_down_shexp.weight ffn_gate.weight ffn_up.weight ffn_down.weight".split()
    ),
    "gemma4": frozenset(
        "token_embd.weight output.weight output_norm.weight rope_freqs.weight per_layer_token_embd.weight "
        "per_layer_model_proj.weight per_layer_proj_norm.weight attn_q.weight attn_k.weight attn_v.weight "
        "attn_output.weight attn_q_norm.weight attn_k_norm.weight ffn_gate.weight ffn_up.weight ffn_down.weight "
        "attn_norm.weight post_attention_norm.weight ffn_norm.weight post_ffw_norm.weight "
        "layer_output_scale.weight inp_gate.weight proj.weight post_norm.weight".split()
    ),
}


def _refuse(model: GGUFModel, what: str, why: str) -> GGUFError:
    return GGUFError(f"{model.files[0]}: {what} is not served for GGUF architecture {model.architecture!r}: {why}")


def _check_tensors(model: GGUFModel, layers: int) -> None:
    """Every tensor of the trunk is one the model reads (the layers past `layers`, llama.cpp's MTP ones, are not)."""
    served = SERVED[model.architecture]
    for name in model.tensors():
        block = _BLOCK.match(name)
        if block and int(block["i"]) >= layers:
            continue
        if (block["stem"] if block else name) not in served:
            raise _refuse(model, f"tensor {name!r}", "the engine has no weight for it")


def _key(model: GGUFModel, suffix: str, default: Any = None) -> Any:
    return model.metadata.get(f"{model.architecture}.{suffix}", default)


def _no_rope_scaling(model: GGUFModel) -> None:
    kind = _key(model, "rope.scaling.type")
    if kind not in (None, "none"):
        raise _refuse(model, f"metadata '{model.architecture}.rope.scaling.type' = {kind!r}", "only unscaled rope")


def _qwen35(model: GGUFModel) -> dict[str, Any]:
    """Qwen3.5 dense: Gated DeltaNet layers (llama.cpp's ssm.* keys) and gated full attention."""
    _no_rope_scaling(model)
    cfg = common(model)
    n = cfg["num_hidden_layers"] = int(_key(model, "block_count")) - int(_key(model, "nextn_predict_layers", 0))
    recurrent: Any = _key(model, "attention.recurrent_layers")
    if recurrent is None:
        every = int(_key(model, "full_attention_interval", 4))
        recurrent = [(i + 1) % every != 0 for i in range(n)]
    v_heads = int(_key(model, "ssm.time_step_rank"))
    head_dim = cfg["head_dim"]
    cfg |= {
        "model_type": "qwen3_5_text",
        "architectures": ["Qwen3_5ForCausalLM"],
        "layer_types": ["linear_attention" if r else "full_attention" for r in list(recurrent)[:n]],
        "linear_conv_kernel_dim": int(_key(model, "ssm.conv_kernel")),
        "linear_key_head_dim": int(_key(model, "ssm.state_size")),
        "linear_num_key_heads": int(_key(model, "ssm.group_count")),
        "linear_num_value_heads": v_heads,
        "linear_value_head_dim": int(_key(model, "ssm.inner_size")) // v_heads,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": cfg.pop("rope_theta"),
            "partial_rotary_factor": int(_key(model, "rope.dimension_count", head_dim)) / head_dim,
        },
    }
    _check_tensors(model, n)
    return cfg


def _granite_ffn(model: GGUFModel, experts: int) -> int:
    shared = _key(model, "expert_shared_feed_forward_length")
    if shared is not None:
        return int(shared)
    if experts:
        raise _refuse(model, "a MoE file without 'expert_shared_feed_forward_length'", "Granite's shared MLP")
    return int(model.tensors()["blk.0.ffn_gate.weight"][1].shape[0])


def _granitehybrid(model: GGUFModel) -> dict[str, Any]:
    """Granite 4.0-H: Mamba-2 layers (per-layer KV head count 0) and attention, Granite's multipliers, rope only
    where `rope.scaling.finetuned` says so (llama.cpp's switch; true by default)."""
    _no_rope_scaling(model)
    cfg = common(model)
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    cfg["head_dim"] = hidden // heads  # llama.cpp's Granite ignores head_dim
    if int(_key(model, "rope.dimension_count", cfg["head_dim"])) != cfg["head_dim"]:
        raise _refuse(model, f"metadata '{model.architecture}.rope.dimension_count'", "partial rotary")
    per_layer: Any = _key(model, "attention.head_count_kv")
    kinds = ["attention" if int(k) else "mamba" for k in per_layer] if hasattr(per_layer, "__len__") else None
    experts = int(_key(model, "expert_count", 0))
    inner, ssm_heads = int(_key(model, "ssm.inner_size")), int(_key(model, "ssm.time_step_rank"))
    tensors = model.tensors()
    cfg |= {
        "model_type": "granitemoehybrid",
        "architectures": ["GraniteMoeHybridForCausalLM"],
        "layer_types": kinds or ["mamba"] * cfg["num_hidden_layers"],
        "shared_intermediate_size": _granite_ffn(model, experts),
        "num_local_experts": experts,
        "num_experts_per_tok": int(_key(model, "expert_used_count", 0)),
        "mamba_n_heads": ssm_heads,
        "mamba_d_head": inner // ssm_heads,
        "mamba_d_state": int(_key(model, "ssm.state_size")),
        "mamba_n_groups": int(_key(model, "ssm.group_count")),
        "mamba_d_conv": int(_key(model, "ssm.conv_kernel")),
        "mamba_expand": inner / hidden,
        "mamba_conv_bias": any(n.endswith("ssm_conv1d.bias") for n in tensors),
        "mamba_proj_bias": False,
        "attention_bias": any(n.endswith("attn_q.bias") for n in tensors),
        "position_embedding_type": "rope" if bool(_key(model, "rope.scaling.finetuned", True)) else "nope",
        "embedding_multiplier": float(_key(model, "embedding_scale", 1.0)),
        "residual_multiplier": float(_key(model, "residual_scale", 1.0)),
        "attention_multiplier": float(_key(model, "attention.scale", cfg["head_dim"] ** -0.5)),
        "logits_scaling": float(_key(model, "logit_scale", 1.0)),
        "vocab_size": int(tensors["token_embd.weight"][1].shape[0]),
    }
    _check_tensors(model, cfg["num_hidden_layers"])
    return cfg


def _f32_tensor(model: GGUFModel, name: str) -> np.ndarray:
    index, info = model.tensors()[name]
    if info.ggml_type != 0:  # F32, as the converter writes it
        raise _refuse(model, f"tensor {name!r} of type {info.ggml_type}", "llama.cpp writes it as F32")
    import numpy as np  # why late: only a hybrid GGUF model reads tensors here (the API process: +0.1 s)

    return np.frombuffer(open_mapped(model.files[index]), dtype=np.float32, count=info.nbytes // 4, offset=info.offset)


def _gemma4_rope(model: GGUFModel, full_dim: int, theta: float) -> dict[str, Any]:
    """The full layers' rope: proportional where `rope_freqs` leaves some pairs unturned (its 1e30 factors)."""
    if "rope_freqs.weight" not in model.tensors():
        return {"rope_type": "default", "rope_theta": theta}
    factors = _f32_tensor(model, "rope_freqs.weight")
    turned = int((factors == 1.0).sum())
    if len(factors) != full_dim // 2 or not (factors[turned:] >= 1e29).all():
        raise _refuse(model, "tensor 'rope_freqs.weight'", "only 1 (turned) then 1e30 (unturned) factors")
    return {"rope_type": "proportional", "rope_theta": theta, "partial_rotary_factor": 2 * turned / full_dim}


def _gemma4_kv(model: GGUFModel, swa: list[bool]) -> tuple[int, int]:
    """(sliding layers' KV heads, full layers')."""
    stated: Any = _key(model, "attention.head_count_kv")
    if not hasattr(stated, "__len__"):
        return int(stated), int(stated)
    local = {int(k) for k, s in zip(stated, swa) if s} or {int(stated[0])}
    full = {int(k) for k, s in zip(stated, swa) if not s} or local
    if len(local) > 1 or len(full) > 1:
        raise _refuse(model, f"metadata '{model.architecture}.attention.head_count_kv' = {list(stated)}", "per type")
    return local.pop(), full.pop()


def _gemma4_checks(model: GGUFModel, cfg: dict[str, Any], shared: int) -> bool:
    """Refuses what the engine's Gemma 4 lacks; returns whether the KV-sharing layers' MLP is double wide."""
    if _key(model, "expert_count"):
        raise _refuse(model, f"metadata '{model.architecture}.expert_count'", "the MoE block is not served")
    local_dim = int(_key(model, "attention.key_length_swa"))
    if int(_key(model, "rope.dimension_count_swa", local_dim)) != local_dim:
        raise _refuse(model, f"metadata '{model.architecture}.rope.dimension_count_swa'", "sliding partial rotary")
    _no_rope_scaling(model)
    ffn: Any = _key(model, "feed_forward_length")
    n, width = cfg["num_hidden_layers"], cfg["intermediate_size"]
    widths = [int(f) for f in ffn] if hasattr(ffn, "__len__") else [width] * n
    double = [width if i < n - shared else 2 * width for i in range(n)]
    if widths not in ([width] * n, double):
        raise _refuse(model, f"metadata '{model.architecture}.feed_forward_length' = {widths}", "per-layer widths")
    return widths == double and shared > 0


def _gemma4(model: GGUFModel) -> dict[str, Any]:
    """Gemma 4 text: sliding / full layers (`sliding_window_pattern`), full layers' own head_dim (`key_length`,
    the sliding ones' `key_length_swa`) and KV heads, k = v where a full layer has no attn_v, per-layer inputs."""
    cfg = common(model)
    swa = [bool(s) for s in _key(model, "attention.sliding_window_pattern")]
    n, shared = cfg["num_hidden_layers"], int(_key(model, "attention.shared_kv_layers", 0))
    local_kv, full_kv = _gemma4_kv(model, swa)
    full_dim, tensors = int(_key(model, "attention.key_length")), model.tensors()
    first_full = next((i for i, s in enumerate(swa) if not s), n - 1)
    ple = int(_key(model, "embedding_length_per_layer_input", 0))
    cfg |= {
        "model_type": "gemma4_text",
        "architectures": ["Gemma4ForCausalLM"],
        "head_dim": int(_key(model, "attention.key_length_swa")),
        "num_key_value_heads": local_kv,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in swa],
        "per_layer_config": {
            str(i): {"head_dim": full_dim, "num_key_value_heads": full_kv} for i in range(n) if not swa[i]
        },
        "attention_k_eq_v": f"blk.{first_full}.attn_v.weight" not in tensors,
        "num_kv_shared_layers": shared,
        "use_double_wide_mlp": _gemma4_checks(model, cfg, shared),
        "sliding_window": int(_key(model, "attention.sliding_window")),
        "hidden_size_per_layer_input": ple,
        "vocab_size": int(tensors["token_embd.weight"][1].shape[0]),
        "hidden_activation": "gelu_pytorch_tanh",
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": float(_key(model, "rope.freq_base_swa", 1e4))},
            "full_attention": _gemma4_rope(model, full_dim, cfg.pop("rope_theta")),
        },
        "enable_moe_block": False,
    }
    if ple:
        cfg["vocab_size_per_layer_input"] = int(tensors["per_layer_token_embd.weight"][1].shape[0])
    if (cap := _key(model, "final_logit_softcapping")) is not None:
        cfg["final_logit_softcapping"] = float(cap)
    _check_tensors(model, n)
    return cfg


HYBRID: dict[str, Callable[[GGUFModel], dict[str, Any]]] = {
    "qwen35": _qwen35,
    "granitehybrid": _granitehybrid,
    "gemma4": _gemma4,
}
