"""Decode steps of a dense bfloat16 model on CPU, each layer in one call (engine/cpu_kernels/decoder_layer.cpp).

A decode step runs about ten kernels per layer; called one by one from Python, their wrappers cost more than the
small ones themselves (bench/README.md, "One call per decoder layer"). Here `CausalLM.forward` hands a pure
decode step (one new token per sequence) to `FusedDecode.run`, which calls the same kernels from C++, in the
same order, rounding the same: the result is bitwise the layer-by-layer path's. Weight-only int8 projections run
through the same kernel, AMX-packed ones through gemm_amx.cpp, a GGUF model's blocks through the block kernel
(engine/cpu_kernels/quant_gemm.cpp).
Gemma 2 and 3 run through it too: their float32 (1 + w) norms, the norms closing each sub-block, the GELU-tanh
MLP and Gemma 3's local rope table for its windowed layers are the kernel's per-layer options.
Models it cannot take (another ops path, LoRA, tensor parallel, OLMo's norms, partial rotary, NoPE layers, MoE,
another activation) never build one.
"""

from __future__ import annotations

import ctypes
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from engine.cpu_kernels import decode_attention, decoder_layer, layer_ops, quant_gemm
from engine.layers.linear import AmxLinear, KernelLinear
from engine.layers.ops import AttnMetadata, rope_halves
from engine.layers.parallel import KERNEL_PARALLEL_BYTES, KERNEL_PARALLEL_MACS, WORKERS
from engine.layers.quant_linear import QuantLinear, QuantPartsLinear
from engine.models.args import ModelArgs

AMX = -2  # decoder_layer.cpp's mark of a projection packed for AMX tiles
FUSED_LINEARS = (KernelLinear, AmxLinear, QuantLinear, QuantPartsLinear)  # the projections the fused layer runs


class DenseModel(Protocol):
    """What FusedDecode reads of engine/models/decoder.py's CausalLM (which decides whether it can take it)."""

    args: ModelArgs
    layers: list[Any]
    scale: float
    cos_sin: torch.Tensor
    rope_tables: list[torch.Tensor]
    layer_rope: list[int]
    dtype: torch.dtype
    layer_windows: list[int | None]

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor: ...


def kernels_take(args: ModelArgs) -> bool:
    """Whether the fused layer's kernels run here and take this decoder's shape (the model checks its layers)."""
    return (
        not args.olmo_norms
        and not any(args.nope_layers)
        and args.rotary_dim == args.head_dim
        and args.head_dim % 32 == 0
        and args.head_dim <= decode_attention.MAX_HEAD_DIM
        and args.num_heads % args.num_kv_heads == 0
        and decoder_layer.available()
        and layer_ops.available()
    )


def _projection(lin: object, keep: list[torch.Tensor]) -> decoder_layer.Projection:
    """The kernel's view of a projection (KernelLinear, AmxLinear or QuantLinear); tensors it points into go to
    `keep`."""
    if isinstance(lin, AmxLinear):
        return decoder_layer.Projection(
            lin.weight.data_ptr(), None, _ptr(lin.bias), lin.out_features, lin.in_features, AMX, 0
        )
    if isinstance(lin, QuantLinear):
        bias = None if lin.bias is None else lin.bias.to(torch.bfloat16).contiguous()
        lin.choice(torch.bfloat16)  # first: the choice may pack the blocks, which moves them
        code, data, row_bytes = lin.kernel_view()
        keep += [data] + ([] if bias is None else [bias])
        return decoder_layer.Projection(
            data.data_ptr(), None, _ptr(bias), lin.out_features, lin.in_features, code, row_bytes
        )
    assert isinstance(lin, KernelLinear)
    p = lin.packed
    return decoder_layer.Projection(p.w_ptr, p.scale_ptr, p.bias_ptr, p.n, p.k, -1, 0)


def _parts(lin: object) -> list[object]:
    """A projection's parts, each into its columns: QuantPartsLinear's (q|k|v or gate|up of differing types)."""
    return [q for _, _, q in lin.parts] if isinstance(lin, QuantPartsLinear) else [lin]


def _projections(lin: object, keep: list[torch.Tensor], most: int) -> tuple[ctypes.Array[Any], int]:
    """The kernel's array of `most` projections for lin's parts, and how many it holds."""
    parts = _parts(lin)
    if len(parts) > most:
        raise ValueError(f"the fused layer takes at most {most} parts of a projection, not {len(parts)}")
    return (decoder_layer.Projection * most)(*(_projection(p, keep) for p in parts)), len(parts)


def _kernel_kind(lin: object) -> tuple[object, ...]:
    """Projections alike in this are alike in which rows the kernel takes (the chooser decides per kind)."""
    ggml = getattr(lin, "ggml", None)
    return type(lin), getattr(ggml, "ggml_type", None), getattr(lin, "out_features"), getattr(lin, "in_features")


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class FusedDecode:
    def __init__(self, model: DenseModel) -> None:
        """model: a dense bf16 CPU model whose projections the kernel runs (CausalLM.fused_decode checks)."""
        self.model = model
        a = model.args
        self.layers: list[decoder_layer.Layer] = []
        self.keep: list[torch.Tensor] = []  # what the structs point into, alive as long as they are
        raw = quant_gemm.raw_product()
        self.quant_gemm = None if raw is None else ctypes.cast(raw, ctypes.c_void_p).value
        # one projection of each kind (type, blocks' type, shape): the chooser's decision (which rows the kernel
        # takes: engine/cpu_kernels/chooser.py) is the kind's
        kinds: dict[tuple[object, ...], Any] = {}
        for layer in model.layers:
            for lin in (layer.qkv, layer.o, getattr(layer.mlp, "gate_up"), getattr(layer.mlp, "down")):
                kinds.update((_kernel_kind(p), p) for p in _parts(lin))
        self.projections: list[KernelLinear | AmxLinear | QuantLinear] = list(kinds.values())
        for i, layer in enumerate(model.layers):
            norms = [
                w.contiguous() if w is not None else None
                for w in (
                    layer.ln2,
                    model.layers[i + 1].ln1 if i + 1 < len(model.layers) else None,
                    layer.q_norm,
                    layer.k_norm,
                    layer.post_attn_norm,
                    layer.post_ff_norm,
                )
            ]
            self.keep += [w for w in norms if w is not None]
            mlp = layer.mlp
            qkv, qkv_parts = _projections(layer.qkv, self.keep, 3)
            gate_up, gate_up_parts = _projections(getattr(mlp, "gate_up"), self.keep, 2)
            self.layers.append(
                decoder_layer.Layer(
                    qkv,
                    _projection(layer.o, self.keep),
                    gate_up,
                    _projection(getattr(mlp, "down"), self.keep),
                    *map(_ptr, norms),
                    None,
                    None,
                    None,
                    a.num_heads,
                    a.num_kv_heads,
                    a.head_dim,
                    a.hidden_size,
                    a.rms_norm_eps,
                    model.scale,
                    a.attn_softcap or 0.0,
                    int(a.gemma_norms),
                    int(getattr(mlp, "act") is not F.silu),  # CausalLM.fused_decode checks: SiLU or gelu_tanh
                    model.layer_rope[i],
                    qkv_parts,
                    gate_up_parts,
                )
            )

    def takes(self, meta: AttnMetadata, tokens: int) -> bool:
        """Whether this step is a pure decode step of the CPU path (one new token per sequence, none prefilling)."""
        d = meta.decodes
        return (
            meta.paged is None
            and d is not None
            and not meta.prefills
            and len(d) == tokens > 0
            and all(p.runs_kernel(tokens) for p in self.projections)
        )

    def run(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttnMetadata,
    ) -> torch.Tensor:
        """Embeddings x [T, hidden] -> hidden states [T, hidden] before the final norm, as run_layers gives them."""
        model, decodes = self.model, meta.decodes
        assert decodes is not None
        x = x.contiguous()
        normed = model.rms_norm(x, model.layers[0].ln1).contiguous()
        (cos, sin), *local = [rope_halves(t[positions], model.dtype) for t in model.rope_tables]
        cos_local, sin_local = local[0] if local else (None, None)
        slots = meta.slot_mapping.contiguous()
        tables, lens, _ = decodes.kernel_args(None)
        los = {w: decodes.kernel_args(w)[2] for w in set(model.layer_windows)}
        k0 = kv_caches[0][0]
        step = decoder_layer.Step(
            x.shape[0],
            cos.data_ptr(),
            sin.data_ptr(),
            slots.data_ptr(),
            tables.data_ptr(),
            tables.stride(0),
            lens.data_ptr(),
            k0.stride(0),
            k0.stride(1),
            k0.stride(2),
            k0.shape[1],
            WORKERS.threads,
            KERNEL_PARALLEL_MACS,
            KERNEL_PARALLEL_BYTES,
            self.quant_gemm,
            _ptr(cos_local),
            _ptr(sin_local),
        )
        xp, np_ = x.data_ptr(), normed.data_ptr()
        for layer, (k_cache, v_cache), window in zip(self.layers, kv_caches, model.layer_windows):
            if k_cache.stride() != k0.stride() or v_cache.stride() != k0.stride():
                raise ValueError("every layer's K and V caches must share one layout")
            layer.k_cache, layer.v_cache, layer.los = k_cache.data_ptr(), v_cache.data_ptr(), los[window].data_ptr()
            decoder_layer.run_layer(layer, step, xp, np_)
        return x
