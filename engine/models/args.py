"""What a checkpoint's config.json says about its decoder: one frozen `ModelArgs` for every family.

The families differ only in these fields (engine/models/decoder.py runs them all): per-head q/k norms
(Qwen3, Gemma 3) or q/k norms over all heads (OLMo 2), Gemma's (1 + w) norms around both sub-blocks, OLMo's
norms closing them only, Gemma's embedding scale and soft-capping, fused q|k|v and gate|up weights (Phi-3),
per-layer sliding windows, rope bases and layers without rope (SmolLM3), sparse MoE blocks.
Each family module turns its config.json into these fields (engine/models/registry.py lists them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


class ConfigError(ValueError):
    """config.json describes something this implementation cannot run; the message names the field."""


@dataclass(frozen=True)
class MoEArgs:
    """Sparse MoE blocks: a router picks `top_k` of `num_experts` gated MLPs per token."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    norm_topk_prob: bool  # renormalise the top-k probabilities to sum to one
    sparse_layers: tuple[bool, ...]  # per layer: a MoE block (True) or the dense MLP
    router_weights_in_model_dtype: bool  # Qwen3-MoE rounds the routing weights to the model dtype; Mixtral not
    block: str  # the block's weight prefix: "mlp" (Qwen3-MoE) or "block_sparse_moe" (Mixtral)
    expert_names: tuple[str, str, str]  # an expert's gate, up, down projections

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ConfigError(f"num_experts_per_tok {self.top_k} must be in 1..num_experts ({self.num_experts})")
        if self.intermediate_size <= 0:
            raise ConfigError("moe_intermediate_size must be positive")


@dataclass(frozen=True)
class ModelArgs:
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # with rope_type; None: plain rope
    max_position_embeddings: int
    tie_word_embeddings: bool | None  # None: config.json does not say
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None  # one window for every layer, or None (per-layer windows: layer_windows)
    hidden_act: str = "silu"
    qk_norm: bool = False  # RMSNorm over each head of q and k before rope (Qwen3, Gemma 3)
    gemma_norms: bool = False  # norms scale by (1 + w) in float32, and also close each sub-block's output
    norm_offset: float = 1.0  # Gemma's norms scale by (norm_offset + w): 1, or 0 for Gemma 4
    embed_scale: bool = False  # embeddings times sqrt(hidden_size), rounded to the model dtype (Gemma)
    attn_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    attn_softcap: float | None = None  # attention logits -> cap * tanh(logits / cap)
    final_softcap: float | None = None  # LM head logits, likewise
    fused_qkv: bool = False  # checkpoint stores self_attn.qkv_proj / mlp.gate_up_proj (Phi-3)
    partial_rotary_factor: float = 1.0  # rope turns the first head_dim * factor dims only
    # per layer: its window (None: full attention); () means `sliding_window` on every layer
    layer_windows: tuple[int | None, ...] = ()
    local_rope_theta: float | None = None  # Gemma 3: the windowed layers' rope base (plain rope)
    moe: MoEArgs | None = None
    # per layer: True where q and k are not turned (SmolLM3's NoPE layers); () means rope on every layer
    nope_layers: tuple[bool, ...] = ()
    olmo_norms: bool = False  # OLMo 2: no input norms, a norm closes each sub-block; weights multiply in float32
    qk_norm_across_heads: bool = False  # OLMo 2: q and k normed over all heads at once, not per head
    extra: dict[str, Any] = field(default_factory=dict, compare=False)  # family-only settings (Qwen2-VL)

    def __post_init__(self) -> None:
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"hidden_act {self.hidden_act!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads {self.num_kv_heads}"
            )
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ConfigError(
                f"layer_types names {len(self.layer_windows)} layers, num_hidden_layers {self.num_layers}"
            )
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ConfigError(
                f"partial_rotary_factor {self.partial_rotary_factor} gives an odd or empty rotary "
                f"dimension for head_dim {self.head_dim}"
            )
        if self.nope_layers and len(self.nope_layers) != self.num_layers:
            raise ConfigError(
                f"no_rope_layers names {len(self.nope_layers)} layers, num_hidden_layers {self.num_layers}"
            )
        if self.moe is not None and len(self.moe.sparse_layers) != self.num_layers:
            raise ConfigError("the MoE layer pattern does not cover num_hidden_layers")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: full attention)."""
        return self.layer_windows or (self.sliding_window,) * self.num_layers


def rope_settings(
    cfg: dict[str, Any], supported: tuple[str, ...], default_theta: float = 10000.0
) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling or None) from either config style: transformers 5 nests them under
    rope_parameters, older configs keep rope_theta / rope_scaling at the top level."""
    rope = dict(cfg.get("rope_parameters") or {})
    theta = float(cfg.get("rope_theta") or rope.get("rope_theta") or default_theta)
    scaling = dict(cfg.get("rope_scaling") or rope or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type not in supported:
        raise ConfigError(
            f"rope_scaling.rope_type {rope_type!r} is not supported for {arch_of(cfg)}; "
            f"supported: default, {', '.join(supported)}"
        )
    scaling["rope_type"] = rope_type
    scaling.pop("type", None)
    if rope_type in ("llama3", "yarn", "longrope"):
        # transformers' rule: a top-level original_max_position_embeddings (Phi-3) wins over the nested one
        orig = cfg.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
        scaling["original_max_position_embeddings"] = int(orig or cfg.get("max_position_embeddings", 4096))
    return theta, scaling


def rope_fields(cfg: dict[str, Any], supported: tuple[str, ...], default_theta: float = 10000.0) -> dict[str, Any]:
    """ModelArgs' rope_theta / rope_scaling, as `rope_settings` reads them."""
    theta, scaling = rope_settings(cfg, supported, default_theta)
    return dict(rope_theta=theta, rope_scaling=scaling)


def layer_type_rope(
    cfg: dict[str, Any],
    arch: str,
    older: Callable[[], tuple[dict[str, Any], dict[str, Any]]],
    supported: tuple[str, ...],
    theta: float,
) -> tuple[float, dict[str, Any] | None, dict[str, Any]]:
    """(full layers' rope_theta, their rope_scaling, the sliding layers' rope parameters) of a family whose layer
    types turn differently: transformers 5 nests one dict per layer type under rope_parameters; an older config's
    (full, sliding) come from `older`. The sliding layers' rope must be plain; `theta`: the full layers' default."""
    nested = cfg.get("rope_parameters") or {}
    if "full_attention" in nested or "sliding_attention" in nested:
        full = dict(nested.get("full_attention") or {})
        local = dict(nested.get("sliding_attention") or {})
    else:
        full, local = older()
    if local.get("rope_type", "default") != "default":
        raise ConfigError(
            f"{arch_of(cfg)} with rope_parameters.sliding_attention.rope_type {local['rope_type']!r} is not "
            "supported; only default"
        )
    positions = cfg.get("max_position_embeddings")
    full_theta, scaling = rope_settings(
        {"rope_parameters": full, "architectures": [arch], "max_position_embeddings": positions}, supported, theta
    )
    return float(full.get("rope_theta") or full_theta), scaling, local


def attention_bias_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """ModelArgs' qkv_bias / o_bias from `attention_bias`: q, k, v and o biased together or not at all."""
    biased = bool(cfg.get("attention_bias"))
    return dict(qkv_bias=biased, o_bias=biased)


def arch_of(cfg: dict[str, Any]) -> str:
    archs = cfg.get("architectures") or ["unknown"]
    return str(archs[0])


def common_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The ModelArgs fields every family reads the same way."""
    heads = int(cfg["num_attention_heads"])
    rope = cfg.get("rope_parameters") or {}
    return dict(
        hidden_size=int(cfg["hidden_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
        intermediate_size=int(cfg["intermediate_size"]),
        vocab_size=int(cfg["vocab_size"]),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=cfg.get("tie_word_embeddings"),
        hidden_act=str(cfg.get("hidden_act") or cfg.get("hidden_activation") or "silu"),
        partial_rotary_factor=float(cfg.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0),
    )


def checked_layer_types(types: list[Any], n: int, supported: tuple[str, ...], named: str = "") -> list[str]:
    """A hybrid config's `layer_types`: every one of `supported`, one per layer (ConfigError naming what is off).
    named: how the error lists the supported types (default: all of them)."""
    unknown = sorted(set(types) - set(supported))
    if unknown:
        raise ConfigError(f"layer_types {unknown} are not supported; supported: {named or ', '.join(supported)}")
    if len(types) != n:
        raise ConfigError(f"layer_types names {len(types)} layers, num_hidden_layers {n}")
    return [str(t) for t in types]


def layer_windows(cfg: dict[str, Any], default_types: list[str] | None = None) -> tuple[int | None, ...]:
    """Per-layer windows from `layer_types` (sliding_attention / full_attention) and `sliding_window`."""
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types") or default_types or ["full_attention"] * n
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise ConfigError(
            f"layer_types {sorted(unknown)} are not supported; supported: sliding_attention, full_attention"
        )
    window = int(cfg.get("sliding_window") or 0)
    if "sliding_attention" in types and not window:
        raise ConfigError("layer_types has sliding_attention layers but sliding_window is not set")
    return tuple(window if t == "sliding_attention" else None for t in types)


def window_fields(windows: tuple[int | None, ...]) -> dict[str, Any]:
    """ModelArgs' sliding_window / layer_windows: one window for all layers when they agree."""
    if len(set(windows)) <= 1:
        return dict(sliding_window=windows[0] if windows else None, layer_windows=())
    return dict(sliding_window=None, layer_windows=windows)


def qwen_windows(cfg: dict[str, Any]) -> tuple[int | None, ...]:
    """Qwen2/Qwen3: windows only with use_sliding_window, on layers from max_window_layers on."""
    n = int(cfg["num_hidden_layers"])
    if not cfg.get("use_sliding_window") or not cfg.get("sliding_window"):
        return (None,) * n
    first = int(cfg.get("max_window_layers") or 0)
    default = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    return layer_windows(cfg, default)


def refuse(cfg: dict[str, Any], **unsupported: Any) -> None:
    """ConfigError naming the first field whose value is one this implementation does not run.

    unsupported: field -> the value that is fine (anything else, when the field is present, is refused)."""
    for name, fine in unsupported.items():
        value = cfg.get(name)
        if name in cfg and value != fine and value is not None:
            raise ConfigError(f"{arch_of(cfg)} with {name}={value!r} is not supported")
